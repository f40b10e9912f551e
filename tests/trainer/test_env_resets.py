"""A batch's envs reset at once (trainer/rollouts/rollout_loop.py, change 4): the same prompts as TRL's sequential resets.

Differential test: one batch through TRL 1.16's `_generate_and_score_completions` and through the stack's trainer
class (trainer.run.grpo_trainer.make_trainer_class), with an in-process env whose `reset` returns an observation that depends
on the row and on the instance (and how often it was reset): the prompts the model is asked to continue, which env
instance got which row, and the rewards must be identical. Concurrency is shown, not timed: in our run every reset
waits on a barrier that only opens once the whole batch is inside `reset` at once (TRL's one-after-another resets
could never open it). A reset that raises surfaces as TRL's does: the first failing row's exception.
"""

from __future__ import annotations

import itertools
import re
import threading

import pytest

ROWS = 4  # prompts per batch; 2 generations each: 8 rollouts, 8 env instances
BARRIER_TIMEOUT_S = 120  # only bounds a failure (a sequential reset would wait here forever), never paces a pass


class ResetProbe:
    """A deterministic env: what reset returns depends only on the row and on this instance's history."""

    barrier: threading.Barrier | None = None  # set by a test: every reset of the batch must be in reset at once
    fail: dict[int, str] = {}  # case -> message of the exception its reset raises
    ids = itertools.count()
    log: list = []

    def __init__(self) -> None:
        self.id = next(ResetProbe.ids)
        self.resets = 0

    def reset(self, **row) -> str:
        if self.barrier is not None:
            self.barrier.wait(BARRIER_TIMEOUT_S)
        self.resets += 1
        case = int(re.search(r"case (\d)", row["prompt"][-1]["content"]).group(1))
        ResetProbe.log.append((self.id, case))
        if case in self.fail:
            raise RuntimeError(self.fail[case])
        return f" Board {case}.{self.resets} (env {self.id})."

    def look(self, text: str) -> str:
        """
        Look.

        Args:
            text: Ignored.
        """
        return "nothing"

    def get_reward(self) -> float:
        return float(self.id * 10 + self.resets)


def run_batch(trainer_cls, tiny_model_dir, tmp_path, batches: int = 2, barrier: bool = False, fail=None):
    """Reset-and-score `batches` batches (the second reuses the pool's instances); returns what the model was asked,
    which env got which row, and the rewards."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    ResetProbe.ids, ResetProbe.log, ResetProbe.fail = itertools.count(), [], fail or {}
    ResetProbe.barrier = threading.Barrier(ROWS * 2) if barrier else None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Reset case {case}."}]} for case in range(ROWS)]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=len(rows),
                      num_generations=2, max_completion_length=16, report_to=[], logging_steps=1,
                      chat_template_kwargs={"enable_thinking": False})
    trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          environment_factory=ResetProbe)
    asked = []

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        asked.append([tokenizer.decode(ids) for ids in prompt_ids])
        out = [tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id] for _ in prompt_ids]
        return out, [[-0.5] * len(ids) for ids in out]

    trainer._generate_single_turn = generate
    rewards = []
    for _ in range(batches):
        out = trainer._generate_and_score_completions([dict(r) for r in rows for _ in range(2)])
        rewards.append(out["advantages"].tolist())
    return asked, sorted(ResetProbe.log), rewards, trainer


@pytest.fixture(scope="module")
def both(tiny_model_dir, tmp_path_factory):
    from trl import GRPOTrainer

    from trainer.run.grpo_trainer import make_trainer_class

    stock = run_batch(GRPOTrainer, tiny_model_dir, tmp_path_factory.mktemp("stock"))
    ours = run_batch(make_trainer_class(), tiny_model_dir, tmp_path_factory.mktemp("ours"), barrier=True)
    return stock, ours


def test_resets_at_once_give_trls_prompts(both):
    (stock_asked, stock_log, stock_rewards, _), (asked, log, rewards, trainer) = both
    assert asked == stock_asked, "the model was asked for different prompts than with TRL's resets"
    assert log == stock_log, "the envs got other rows than with TRL's resets"
    assert rewards == stock_rewards
    # Guards: each prompt carries its own observation, from the second reset of a reused instance in batch 2.
    assert all(f"Reset case {k // 2}. Board {k // 2}.1 (env" in p for k, p in enumerate(stock_asked[0]))
    assert all(f"Board {k // 2}.2 (env" in p for k, p in enumerate(stock_asked[1]))
    assert len({env for env, _ in stock_log}) == ROWS * 2
    # Every reset was in flight at once (the barrier opened twice), and no replay is left on an instance.
    assert ResetProbe.barrier.n_waiting == 0 and not ResetProbe.barrier.broken
    assert all("reset" not in vars(env) for env in trainer._environment_pool[None])


@pytest.mark.parametrize("trainer_name", ["stock", "ours"])
def test_a_failing_reset_surfaces_as_in_trl(trainer_name, tiny_model_dir, tmp_path):
    from trl import GRPOTrainer

    from trainer.run.grpo_trainer import make_trainer_class

    cls = GRPOTrainer if trainer_name == "stock" else make_trainer_class()
    with pytest.raises(RuntimeError, match=r"^reset 1 broke$"):  # the first failing row in batch order
        run_batch(cls, tiny_model_dir, tmp_path, batches=1, fail={1: "reset 1 broke", 3: "reset 3 broke"})


def test_reset_all_is_bounded_by_tool_concurrency():
    """With TOOL_CONCURRENCY=2, a barrier of 2 opens; results keep the batch's order."""
    from trainer.rollouts.rollout_loop import reset_all

    in_reset, peak, lock = 0, 0, threading.Lock()
    gate = threading.Barrier(2)

    class Env:
        def reset(self, n):
            nonlocal in_reset, peak
            with lock:
                in_reset += 1
                peak = max(peak, in_reset)
            gate.wait(BARRIER_TIMEOUT_S)  # pairs: two at once, never one alone
            with lock:
                in_reset -= 1
            return n * n

    replays = reset_all([Env() for _ in range(6)], [{"n": n} for n in range(6)], concurrency=2)
    assert [r() for r in replays] == [0, 1, 4, 9, 16, 25]
    assert peak == 2


# ---------------------------------------------------------------------------------------------- the pin
# The TRL sources whose reset loop trainer/rollouts/rollout_loop.py runs ahead of it (GRPOTrainer._generate_and_score_completions) are pinned in trainer/core/trl_privates.py (tests/trainer/test_trl_privates.py).
