"""Which tokens of a multi-turn episode GRPO trains on, checked on the real trainer and the real echo server.

The model's two turns are scripted (a tool call, then a short final answer), so the episode is known token
for token; everything else is TRL's own code path: the tool loop calls the real EchoTool over /ws, builds the
tool suffix from the chat template, and `_generate_and_score_completions` returns the masks the loss uses.
Trained = completion_mask * tool_mask (what `_compute_loss` multiplies the per-token loss by).
"""

from __future__ import annotations

import pytest
from contract.config import CpuMode
from trainer.core import grpo_args

CALL = '<tool_call>\n{"name": "echo_message", "arguments": {"message": "apple"}}\n</tool_call>'
ANSWER = "Done."


@pytest.fixture
def scripted_trainer(tmp_path, tiny_model_dir, echo_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from envs import registry
    from contract.config import RunConfig
    from trainer.rollouts.envs_binding import bind
    from trainer.run.dataset import build_dataset

    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
                          "--env-name", "echo", "--env-urls", f"echo={echo_server.url}", "--num-generations", "2",
                          "--per-device-train-batch-size", "2", "--max-completion-length", "96",
                          "--dataset-size", "2"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    specs = {"echo": registry.get("echo")}
    dataset = build_dataset(cfg, specs)
    factory = bind("echo", specs["echo"].tool_class, echo_server.url)
    trainer = GRPOTrainer(model=model, args=grpo_args.grpo_config(cfg.resolved(CpuMode())), train_dataset=dataset,
                          processing_class=tokenizer, environment_factory=factory)

    turns = [tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id],
             tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]]
    calls = []

    def scripted_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append(len(prompt_ids))
        return [list(turns[len(calls) - 1]) for _ in prompt_ids], None

    trainer._generate_single_turn = scripted_turn
    row = dict(dataset[0])
    return trainer, tokenizer, [row, row], turns, calls


def test_assistant_turns_are_trained_tool_results_and_prompt_are_not(scripted_trainer):
    from trl.chat_template_utils import get_training_chat_template

    trainer, tokenizer, inputs, turns, calls = scripted_trainer
    out = trainer._generate_and_score_completions(inputs)
    assert calls == [2, 2], "one first turn and one post-tool turn per rollout"

    for i in range(2):
        ids = out["completion_ids"][i].tolist()
        trained = (out["completion_mask"][i] * out["tool_mask"][i]).tolist()
        n = int(out["completion_mask"][i].sum())
        ids, trained = ids[:n], trained[:n]
        first, second = turns
        # The completion = first turn, then the tool suffix, then the final turn; nothing of the prompt.
        assert ids[:len(first)] == first and ids[-len(second):] == second
        suffix = ids[len(first):n - len(second)]
        assert trained == [1] * len(first) + [0] * len(suffix) + [1] * len(second)

        suffix_text = tokenizer.decode(suffix)
        # What the model reads between its turns: the template's tool block and the next assistant header.
        assert suffix_text.startswith("\n<|im_start|>user\n<tool_response>\n")
        assert "</tool_response><|im_end|>\n<|im_start|>assistant\n" in suffix_text
        assert "<tool_response>\napple\n</tool_response>" in suffix_text  # the real server's answer
        # Both assistant turns end in EOS, and the EOS is trained: the template closes an assistant turn with it.
        assert ids[len(first) - 1] == tokenizer.eos_token_id and ids[-1] == tokenizer.eos_token_id
        assert trained[len(first) - 1] == 1 and trained[-1] == 1

        # The whole sequence is token for token what the training template renders for this conversation, up to
        # the final turn's EOS (the template writes a newline after it that the model never generates).
        prompt_ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        messages = [*trainer_prompt(inputs[i]), {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "echo_message", "arguments": {"message": "apple"}}}]},
            {"role": "tool", "name": "echo_message", "content": "apple"}, {"role": "assistant", "content": ANSWER}]
        rendered = tokenizer.apply_chat_template(
            messages, tools=trainer.tools, chat_template=get_training_chat_template(tokenizer), tokenize=True,
            return_dict=True, **trainer.chat_template_kwargs)["input_ids"]
        last_eos = len(rendered) - 1 - rendered[::-1].index(tokenizer.eos_token_id)
        assert tokenizer.decode(rendered[last_eos + 1:]) == "\n"
        assert prompt_ids + ids == rendered[:last_eos + 1]


def trainer_prompt(row: dict) -> list[dict]:
    return [dict(m) for m in row["prompt"]]
