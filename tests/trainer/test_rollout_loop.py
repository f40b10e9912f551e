"""trainer.rollouts.rollout_loop: the same episodes as TRL's own tool loop, and the TRL source it copies, pinned.

Differential test: one batch of scripted episodes (every model turn is fixed by the prompt's case number and
the turn index, so both loops see the same generations) runs through TRL 1.16's `_tool_call_loop` and through
ours; completions, token ids, tool masks, logprobs and counts must be identical. The cases cover what the loop
decides: no call, one call, several calls in a turn (sync and async, whose result order TRL fixes), an unknown
tool, a tool that raises, the iteration limit, a tool result rolled back as overlong, a final turn truncated to
the budget.
"""

from __future__ import annotations

import copy
import inspect
import json
import re

import pytest

MAX_COMPLETION_LENGTH = 200
MAX_ITERATIONS = 3


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# case -> the model's turns, in order (the last one repeats if the episode goes on).
SCRIPTS = {
    0: ["Done."],
    1: [call("note", text="apple"), "Done."],
    2: [call("ping", text="first") + "\n" + call("note", text="second"), call("note", text="third"), "Done."],
    3: [call("missing_tool", text="x"), "Done."],
    4: [call("explode", text="x"), "Done."],
    5: [call("note", text="again")],  # never stops calling: ends at the iteration limit
    6: [call("big", text="x"), "Done."],  # its result cannot fit the budget: rolled back
    7: [call("note", text="river"), " ".join(["long answer"] * 80)],  # cut to the budget
}


class ScriptedTools:
    """A deterministic in-process env: what it returns depends only on the calls so far."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def reset(self, **row) -> None:
        self.notes = []

    def note(self, text: str) -> str:
        """
        Write a note.

        Args:
            text: The note.
        """
        self.notes.append(text)
        return f"noted {text} ({len(self.notes)})"

    async def ping(self, text: str) -> str:
        """
        Ping with a text.

        Args:
            text: What to send.
        """
        return f"pong {text}"

    def explode(self, text: str) -> str:
        """
        Always fails.

        Args:
            text: Ignored.
        """
        raise RuntimeError("the tool broke")

    def big(self, text: str) -> str:
        """
        Return a long text.

        Args:
            text: Ignored.
        """
        return " ".join(["stone"] * 400)

    def get_reward(self) -> float:
        return float(len(self.notes))


def scripted_generation(tokenizer, record: list):
    """A `_generate_single_turn` whose turns come from SCRIPTS, keyed by the prompt's case and the turn index."""

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        record.append([list(ids) for ids in prompt_ids])
        out = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids)
            case = int(re.search(r"case (\d)", text).group(1))
            turn = text.count("<|im_start|>assistant") - 1
            script = SCRIPTS[case]
            ids_out = tokenizer.encode(script[min(turn, len(script) - 1)], add_special_tokens=False)
            out.append(ids_out + [tokenizer.eos_token_id])  # one per prompt: rows come repeated, as in training
        return out, [[-0.5] * len(ids) for ids in out]  # logprobs as vLLM modes return them

    return generate


def build(trainer_cls, tiny_model_dir, tmp_path, record, reward_funcs=None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Scripted case {case}."}]} for case in SCRIPTS]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=len(rows),
                      num_generations=2, max_completion_length=MAX_COMPLETION_LENGTH,
                      max_tool_calling_iterations=MAX_ITERATIONS, report_to=[], logging_steps=1,
                      chat_template_kwargs={"enable_thinking": False})
    reward_funcs = reward_funcs(model, tokenizer) if reward_funcs else None
    trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          environment_factory=ScriptedTools, reward_funcs=reward_funcs)
    trainer._generate_single_turn = scripted_generation(tokenizer, record)
    return trainer, rows


def run_loop(trainer_cls, tiny_model_dir, tmp_path):
    """(the loop's return value, every generation request), for one batch of all the cases."""
    record, returned = [], []

    class Recording(trainer_cls):
        def _tool_call_loop(self, *args):
            returned.append(super()._tool_call_loop(*args))
            return returned[-1]

    trainer, rows = build(Recording, tiny_model_dir, tmp_path, record)
    trainer._generate_and_score_completions([dict(r) for r in rows for _ in range(2)])  # 2 generations each
    assert len(returned) == 1
    return copy.deepcopy(returned[0]), record


@pytest.fixture(scope="module")
def both_loops(tiny_model_dir, tmp_path_factory):
    from trl import GRPOTrainer

    from trainer.rollouts.rollout_loop import make_rollout_loop_class

    stock = run_loop(GRPOTrainer, tiny_model_dir, tmp_path_factory.mktemp("stock"))
    ours = run_loop(make_rollout_loop_class(GRPOTrainer), tiny_model_dir, tmp_path_factory.mktemp("ours"))
    return stock, ours


def test_same_episodes_as_trls_loop(both_loops):
    (stock, stock_requests), (ours, our_requests) = both_loops
    names = ["tool_mask", "completions", "completion_ids", "logprobs", "tool_call_count", "tool_failure_count",
             "tool_images"]
    for name, theirs, mine in zip(names, stock, ours, strict=True):
        assert mine == theirs, f"{name} differs from TRL's loop"
    assert our_requests == stock_requests, "the model was asked for different turns"


def test_the_batch_covers_every_decision_of_the_loop(both_loops):
    """Guards the differential test: each case did what it is there for (else equality proves little)."""
    (stock, _), _ = both_loops
    tool_mask, completions, completion_ids, logprobs, calls, failures, _ = stock
    by_case = {case: completions[2 * i] for i, case in enumerate(SCRIPTS)}  # 2 generations per prompt

    def tool_contents(messages):
        return [m["content"] for m in messages if m["role"] == "tool"]

    assert [m["role"] for m in by_case[0]] == ["assistant"]
    assert tool_contents(by_case[1]) == ["noted apple (1)"]
    # Two calls in one turn: the sync result first, then the async one (TRL's order), then the next round.
    assert tool_contents(by_case[2]) == ["noted second (1)", "pong first", "noted third (2)"]
    assert tool_contents(by_case[3]) == [str({"error": "Tool missing_tool not found."})]
    assert tool_contents(by_case[4]) == [str({"error": "the tool broke"})]
    assert len(tool_contents(by_case[5])) == MAX_ITERATIONS and "tool_calls" in by_case[5][-1]
    assert tool_contents(by_case[6]) == [] and len(by_case[6]) == 1  # rolled back: the call stays unanswered
    assert len(completion_ids[2 * 7]) == MAX_COMPLETION_LENGTH  # final turn cut to the budget
    assert calls == 2 * (1 + 3 + 1 + 1 + MAX_ITERATIONS + 1 + 1) and failures == 2 * 2
    assert all(len(m) == len(ids) == len(lp) for m, ids, lp in zip(tool_mask, completion_ids, logprobs, strict=True))


# ---------------------------------------------------------------------------------------------- the pin
# The sources this loop copies or relies on are pinned in trainer/core/trl_privates.py (tests/trainer/test_trl_privates.py).


def test_trl_calls_the_loop_with_the_pinned_signature():
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate)
    assert re.search(r"self\._tool_call_loop\(\s*prompts, prompt_ids, completion_ids, completions, logprobs, images, "
                     r"multimodal_fields\s*\)", source), "GRPOTrainer._generate calls _tool_call_loop differently"
    assert "tool_failure_count,\n                tool_images,\n            ) = self._tool_call_loop(" in source


def test_in_server_mode_an_episode_ends_where_vllm_would_refuse_its_next_turn():
    """TRL checks a post-tool input against the model's max_position_embeddings in server mode; vLLM refuses it
    once input + max_tokens passes its max_model_len (tests/gpu_path/test_vllm_cpu_twin.py shows the boundary)."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from trainer.rollouts.rollout_loop import make_rollout_loop_class

    fits = make_rollout_loop_class(GRPOTrainer)._input_fits
    server = SimpleNamespace(use_vllm=True, vllm_mode="server", server_max_model_len=4096, max_completion_length=256,
                             _is_vlm=False, model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40960)))
    assert fits(server, 4096 - 256) and not fits(server, 4096 - 256 + 1)
    unknown = SimpleNamespace(**{**vars(server), "server_max_model_len": None})  # not reported: TRL's rule
    assert fits(unknown, 40959) and not fits(unknown, 40960)
