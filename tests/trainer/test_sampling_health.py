"""contract/sampling_health.py: is vLLM's sampling still the trainer's policy? Pure functions over metric rows, the
watch that marks `make gpu-smoke`'s stage and warns once, and the masked share the trainer logs."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest

from contract.config import GpuMode
from tools.commands import smoke
from contract import sampling_health as sh
from contract import stages


def row(step, mean=None, masked=None, **extra):
    r = {"kind": "step", "step": step, **extra}
    if mean is not None:
        r[sh.RATIO_MEAN] = mean
    if masked is not None:
        r[sh.MASKED_FRACTION] = masked
    return r


def test_rows_in_bounds_pass_with_their_figures():
    ok, detail = sh.verdict([row(1, 0.5, 0.5), row(2, 0.97, 0.0), row(3, 1.02, 0.1)])  # step 1 is not judged
    assert ok is True and "step 2: ratio mean 0.970, masked 0%" in detail and "step 3" in detail


@pytest.mark.parametrize("rows,why", [
    ([row(2, 0.79, 0.0), row(3, 1.0, 0.0)], "step 2: mean importance-sampling ratio 0.790 outside [0.8, 1.25]"),
    ([row(2, 1.0, 0.0), row(3, 1.26, 0.0)], "step 3: mean importance-sampling ratio 1.260 outside [0.8, 1.25]"),
    ([row(2, 1.0, 0.11), row(3, 1.0, 0.0)], "step 2: 11% of sequences masked (> 10%)"),
    ([row(2, float("inf"), 0.0)], "outside [0.8, 1.25]"),
])
def test_rows_out_of_bounds_fail_naming_the_step_and_the_figure(rows, why):
    ok, detail = sh.verdict(rows)
    assert ok is False and why in detail


def test_no_figures_at_the_judged_steps_is_no_verdict():
    assert sh.verdict([row(2), row(3)]) == (None, "no importance-sampling figures at steps 2-3")
    assert sh.verdict([row(2, float("nan"))])[0] is None  # NaN is no figure


def test_watch_marks_the_stage_after_step_3_and_warns_once():
    marks, warnings = [], []
    watch = sh.Watch(lambda *a, **k: marks.append((a, k)), warnings.append)
    for r in [row(1, 1.0, 0.0), row(2, 1.0, 0.0), row(3, 0.99, 0.02), row(4, 0.5, 0.3), row(5, 0.4, 0.4)]:
        watch.observe(r)
    assert len(marks) == 1 and marks[0][0][0] == "importance_sampling" and marks[0][1] == {"ok": True}
    assert len(warnings) == 1 and warnings[0].startswith("WARNING step 4: mean importance-sampling ratio 0.500")
    assert "30% of sequences masked" in warnings[0]


def test_cpu_profile_rows_carry_no_figures_and_nothing_happens():
    marks, warnings = [], []
    watch = sh.Watch(lambda *a, **k: marks.append(a), warnings.append)
    for step in range(1, 6):
        watch.observe(row(step, reward=0.5))
    assert marks == [] and warnings == []


def test_gpu_smoke_fails_on_the_stage_verdict():
    base = [f'[stage] {{"stage": "{s}", "seconds": 1.0}}' for s in
            ("model_download", "vllm_healthy", "rendezvous", "first_generation", "first_optimizer_step",
             "first_weight_sync")] + ['[stage] {"stage": "tool_calls", "value": 1.0}']

    def table(record):
        return smoke.smoke_table(GpuMode(), stages.parse("\n".join([*base, "[stage] " + record])), failed_rc=0)

    lines, ok = table('{"stage": "importance_sampling", "seconds": null, "detail": "step 2: ratio mean 1.0", "ok": true}')
    assert ok and any(line.startswith("  pass importance sampling") for line in lines)
    lines, ok = table('{"stage": "importance_sampling", "seconds": null, "detail": "step 2: 40% of sequences masked '
                      '(> 10%)", "ok": false}')
    bad = next(line for line in lines if "importance sampling" in line)
    assert not ok and bad.startswith("  FAIL") and "40% of sequences masked" in bad and "make nccl-check FULL=1" in bad
    lines, ok = smoke.smoke_table(GpuMode(), stages.parse("\n".join(base)), failed_rc=0)
    assert not ok and "never reached" in next(line for line in lines if "importance sampling" in line)


def test_masked_share_logged_by_the_trainer__stand_in_trainer_and_batch():
    """TRL's batch output and accelerator are stood in (no vLLM here): the trainer's own method computes the share."""
    import torch

    from trainer.run.grpo_trainer import make_trainer_class

    log_masked = make_trainer_class()._log_masked_fraction

    def stand_in(mode):  # what the method reads of a GRPOTrainer; TRL's _metrics is a defaultdict of lists too
        return types.SimpleNamespace(vllm_importance_sampling_mode=mode, model=types.SimpleNamespace(training=True),
                                     accelerator=types.SimpleNamespace(gather=lambda t: t),
                                     _metrics={"train": defaultdict(list)})

    seq = stand_in("sequence_mask")
    log_masked(seq, {"importance_sampling_ratio": torch.tensor([[0.0], [1.1], [0.9], [0.0]])})
    assert seq._metrics["train"][sh.MASKED_FRACTION] == [0.5]

    tok = stand_in("token_mask")
    ratio = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    tool_mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # the masked token of row 2 is a tool result: not counted
    log_masked(tok, {"importance_sampling_ratio": ratio, "completion_mask": completion_mask, "tool_mask": tool_mask})
    assert tok._metrics["train"][sh.MASKED_FRACTION] == [pytest.approx(1 / 6)]

    trunc = stand_in("sequence_truncate")
    log_masked(trunc, {"importance_sampling_ratio": torch.tensor([[3.0]])})
    assert sh.MASKED_FRACTION not in trunc._metrics["train"]  # truncation masks nothing


def test_the_step_line_shows_the_ratio_only_where_vllm_generates():
    from trainer.core.metrics import MetricsCallback

    args = types.SimpleNamespace(max_steps=3)
    line = MetricsCallback._progress_line(row(2, 0.981, 0.05, reward=0.5), args)
    assert line.endswith(" is_ratio 0.981 masked 5%")
    assert "is_ratio" not in MetricsCallback._progress_line(row(2, reward=0.5), args)  # the CPU profile
