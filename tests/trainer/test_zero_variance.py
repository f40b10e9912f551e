"""#43 item 2: zero-variance GRPO groups (trainer.rollouts.zero_variance).

Before: both modes kept a group whose completions all scored alike in the loss's normaliser (advantage 0, tokens
counted, every other token's weight shrunk), and an async run logged no share of them at all. Now the share is logged
under TRL's sync key in both modes, and ZERO_STD_GROUPS=drop takes such groups out of the normaliser the way episodes
the env side ended are taken out (trainer.rollouts.infra_failures).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tests.trainer.worker_loops import close, drained, echo_worker_loop, run_until
from trainer.rollouts import infra_failures, zero_variance
from trainer.rollouts.zero_variance import flat_rows, is_flat

NAN = float("nan")


# ---------------------------------------------------------------------------- what a flat group is
def test_a_flat_group_is_one_whose_scored_rewards_all_agree():
    assert is_flat([0.2, 0.2, 0.2, 0.2]) and is_flat([1.0, NAN, 1.0])  # an unscored row does not count
    assert not is_flat([0.2, 0.2, 1.0, 0.2])
    assert not is_flat([1.0, NAN, NAN]) and not is_flat([NAN, NAN])  # fewer than two scored: TRL's nanstd is NaN
    assert flat_rows([1, 1, 0, 1, 0.5, 0.5], 2) == [True, True, False, False, True, True]
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        flat_rows([1, 1, 1, 1, 1], 2)


def test_flat_groups_are_the_ones_trl_counts_in_frac_reward_zero_std():
    """The same test as TRL 1.16's own metric (nanstd per group, torch.isclose to 0), on random batches with ties,
    near-ties and unscored rows, in float64 (TRL's float32 misses some: the next test)."""
    from trl.trainer.utils import nanstd

    rng = random.Random(7)
    for _ in range(100):
        group = rng.choice([2, 4, 8])
        rewards = []
        for _ in range(4):
            base = rng.choice([0.0, 0.2, 1.0])
            rewards += [rng.choice([base, base, base + rng.choice([1e-3, 1e-12]), NAN]) for _ in range(group)]
        std = nanstd(torch.tensor(rewards, dtype=torch.float64).view(-1, group), dim=1)
        trl_says = torch.isclose(std, torch.zeros_like(std)).repeat_interleave(group).tolist()
        assert flat_rows(rewards, group) == trl_says, rewards


def test_sync_logs_the_share_as_the_async_worker_counts_it():
    """TRL 1.16 computes frac_reward_zero_std in float32: eight rewards of 0.2 (echo's partial reward) have a std of
    1.6e-8 there, above its 1e-8 tolerance, so a batch of such groups logged 0.0. The stack's value replaces it."""
    from trl.trainer.utils import nanstd

    std = nanstd(torch.full((1, 8), 0.2), dim=1)
    assert not torch.isclose(std, torch.zeros_like(std)).item()  # TRL's own test, on TRL's dtype: "not flat"
    trainer = sync_trainer("keep", [None] * 16)
    trainer.num_generations = 8
    rewards = torch.tensor([0.2] * 8 + [0.2] * 7 + [1.0]).unsqueeze(1)
    zero_variance.leave_out_of_normaliser(trainer, infra_failures.leave_out_rewards(trainer, rewards))
    trainer._metrics["train"][zero_variance.METRIC].append(0.0)  # what TRL appends for this batch
    zero_variance.log_share(trainer)
    assert trainer._metrics["train"][zero_variance.METRIC] == [0.5]
    assert not trainer._infra_any and not trainer._infra_rows.any()  # keep: nothing leaves the loss


# ---------------------------------------------------------------------------- sync: the normaliser
def sync_trainer(zero_std_groups: str, infra: list[str | None], processes: int = 1, index: int = 0):
    return SimpleNamespace(
        zero_std_groups=zero_std_groups, num_generations=2, num_generations_eval=2, reward_weights=torch.ones(1),
        model=SimpleNamespace(training=True), environments=[SimpleNamespace(_infra_failure=w) for w in infra],
        accelerator=SimpleNamespace(num_processes=processes, process_index=index, gather=lambda t: t.reshape(-1)),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


def generation_output(lengths: list[int]) -> dict:
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return {"completion_mask": mask, "tool_mask": None, "num_items_in_batch": mask.sum()}


def score(trainer, rewards: list[float], lengths: list[int]) -> dict:
    """The stack's reward step then its loss-mask step, as InstrumentedGRPOTrainer runs them around TRL's."""
    rewards_per_func = infra_failures.leave_out_rewards(trainer, torch.tensor(rewards).unsqueeze(1))
    zero_variance.leave_out_of_normaliser(trainer, rewards_per_func)
    return infra_failures.leave_out_of_loss(trainer, generation_output(lengths))


def test_drop_takes_flat_groups_out_of_the_loss_and_its_token_count():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.2, 0.2]  # groups of two: flat, mixed, flat
    lengths = [3, 5, 7, 2, 4, 6]
    kept = score(sync_trainer("keep", [None] * 6), rewards, lengths)
    assert int(kept["num_items_in_batch"]) == sum(lengths)  # TRL's behaviour: every token counts
    dropped = score(sync_trainer("drop", [None] * 6), rewards, lengths)
    assert int(dropped["num_items_in_batch"]) == 7 + 2  # only the mixed group's tokens
    assert dropped["completion_mask"].sum(1).tolist() == [0, 0, 7, 2, 0, 0]


def test_drop_works_alongside_episodes_the_env_side_ended():
    """An env-ended episode is not scored: its group's other member alone is not a flat group (TRL: nanstd NaN), and
    a group flat among its scored members is dropped whole, the env-ended row included (it was out already)."""
    rewards = [1.0, 0.0, 0.5, 0.5, 0.5, 0.7]
    lengths = [3, 5, 7, 2, 4, 6]
    out = score(sync_trainer("drop", [None, "reset failed", None, None, None, None]), rewards, lengths)
    assert out["completion_mask"].sum(1).tolist() == [3, 0, 0, 0, 4, 6]
    assert int(out["num_items_in_batch"]) == 13


def test_each_process_drops_its_own_rows_of_the_gathered_batch():
    gathered = torch.tensor([[1.0], [1.0], [0.0], [1.0]])  # process 0: the flat group; process 1: the mixed one
    for index, expected in ((0, [True, True]), (1, [False, False])):
        trainer = sync_trainer("drop", [None, None], processes=2, index=index)
        trainer._infra_rows, trainer._infra_any = torch.zeros(2, dtype=torch.bool), False
        zero_variance.leave_out_of_normaliser(trainer, gathered)
        assert trainer._infra_rows.tolist() == expected and trainer._infra_any  # both recount the normaliser


def test_keep_eval_and_normalize_then_sum_leave_the_batch_alone():
    for trainer in (sync_trainer("keep", [None] * 2), sync_trainer("drop", [None] * 2)):
        if trainer.zero_std_groups == "drop":
            trainer.model.training = False
        zero_variance.leave_out_of_normaliser(trainer, torch.tensor([[1.0], [1.0]]))
        assert not hasattr(trainer, "_infra_rows")
    trainer = sync_trainer("drop", [None] * 2)
    trainer.multi_objective_aggregation = "normalize_then_sum"  # a flat group's advantage is not 0 there
    zero_variance.leave_out_of_normaliser(trainer, torch.tensor([[1.0], [1.0]]))
    assert not hasattr(trainer, "_infra_rows")


def test_the_setting_is_one_flat_env_name_defaulting_to_trls_behaviour(monkeypatch):
    from contract.config import RunConfig

    assert RunConfig.load([]).zero_std_groups == "keep"
    monkeypatch.setenv("ZERO_STD_GROUPS", "drop")
    assert RunConfig.load([]).zero_std_groups == "drop"


# ---------------------------------------------------------------------------- async: TRL's real rollout loop
def async_loop(tmp_path, tiny_model_dir, url, zero_std_groups: str, mixed: bool):
    """TRL 1.16's rollout loop with the stack's mixins against a real echo server; vLLM replaced by a script that calls
    echo_message once (with the prompt's target word on every other rollout when `mixed`: one FULL, one PARTIAL per
    group of two; else "hello" always: every group flat), then answers."""
    from trainer.async_grpo.async_run import TracedRolloutLoop

    class Scripted(TracedRolloutLoop):
        calls = 0

        async def _generate_one_turn(self, prompt_ids):
            seen = self.tokenizer.decode(prompt_ids)
            if "<tool_response>" in seen:
                text = "done<|im_end|>"
            else:
                Scripted.calls += 1
                word = seen.rsplit("say the word: ", 1)[1].split("<")[0].strip() if mixed and Scripted.calls % 2 else "hello"
                text = f'<tool_call>\n{{"name": "echo_message", "arguments": {{"message": "{word}"}}}}\n</tool_call><|im_end|>'
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids, [-0.5] * len(ids)

    # one rollout at a time: the script's alternation is per group
    return echo_worker_loop(Scripted, tmp_path, tiny_model_dir, url, max_inflight_tasks=1, trace_every=0,
                            trace_samples=0, zero_std_groups=zero_std_groups)


def run_groups(loop, groups: int) -> tuple[list, dict]:
    """Drive the loop until `groups` groups are scored; return the queued samples and the reduced metrics."""
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    try:
        run_until(loop, lambda: loop._total_groups_scored >= groups)
    finally:
        close(loop)
    samples, sink = drained(loop)
    return samples, {k: _reduce_metric(k, v) for k, v in sink.items()}


@pytest.mark.parametrize("zero_std_groups", ["keep", "drop"])
def test_async_logs_the_share_under_the_sync_key_and_drop_keeps_flat_groups_from_the_queue(
        zero_std_groups, tmp_path, tiny_model_dir, echo_server):
    from trainer.core import async_metrics

    samples, reduced = run_groups(async_loop(tmp_path, tiny_model_dir, echo_server.url, zero_std_groups, False), 2)
    record = async_metrics.record(reduced)
    assert record[zero_variance.METRIC] == 1.0  # every group said "hello": all PARTIAL, all flat
    if zero_std_groups == "keep":
        assert samples and all(s.advantage == 0.0 for s in samples)  # trained with advantage 0, tokens counted
    else:
        assert samples == []  # never trained: out of the trainer's token count


def test_async_drop_keeps_groups_that_teach(tmp_path, tiny_model_dir, echo_server):
    samples, reduced = run_groups(async_loop(tmp_path, tiny_model_dir, echo_server.url, "drop", True), 2)
    assert reduced[zero_variance.METRIC] == 0.0
    assert len(samples) >= 4 and {round(s.metrics["reward"], 3) for s in samples} == {1.0, 0.2}
    assert all(not math.isclose(s.advantage, 0.0) for s in samples)
