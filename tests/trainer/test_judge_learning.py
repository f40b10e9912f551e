"""The policy learns from a judge alone (issue 64, item 7): the CPU profile's tiny model trained on echo with
ENV_REWARD_WEIGHT=0 and the tiny judge (trainer.tiny_judge) served by the REAL vLLM CPU twin's image with the judge
service's flags, judged through the real rubric. The env still computes its reward; it weighs 0, so what is learned
comes from the judge's digits. Measured as test_learning.py measures the env's case: greedy exact first calls on
held-out rows, before and after (deterministic given the weights); and the path: every step judged, no failed call,
the judge's cost in every step record.

What this judge teaches is the call (it grades any echo call 9, a call with another word too: docs/judge.md), so the
bar is on greedy first turns that call the tool, and exact calls well above the base. Measured (2026-12-07, this
2-core machine loaded to a load average of 20-30): seed 42 after 10 steps (this test): exact 0.80 (0.00 before);
bench/judge_learning.py after 20 steps: seed 42 calls 1.00, exact 0.60; seed 7 calls 1.00, exact 1.00. Bars: calls
>= 0.6, exact >= 0.4 (0.2 under the lowest measured exact share). Its time: 194 s with the tiny judge made earlier
(TINY_JUDGE_DIR; twin start 55 s; calls 1.00, exact 0.80 again), 892 s under a load average of 20-30; on an idle machine the twin's ~30 s and 10 steps of ~5 s, plus
the tiny judge's SFT unless TINY_JUDGE_DIR names one made earlier.
"""

from __future__ import annotations

import pytest

from bench.judge_learning import judge_args, serve_judge, stop_judge
from tests.gpu_path.conftest import VLLM_CPU_IMAGE, ensure_vllm_cpu_image
from tests.helpers import LEARN_SEEDS, make_tiny_judge
from trainer import train
from trainer.after import first_turn
from trainer.core.metrics import read_metrics

pytestmark = [pytest.mark.docker, pytest.mark.twin, pytest.mark.timeout(900)]  # the twin serves the judge

STEPS = 10


@pytest.fixture(scope="module")
def judge_url(docker, tmp_path_factory):
    ensure_vllm_cpu_image()
    name, url, _ = serve_judge(make_tiny_judge(tmp_path_factory.mktemp("judge") / "tiny-judge"), VLLM_CPU_IMAGE)
    try:
        yield url
    finally:
        stop_judge(name)


@pytest.mark.parametrize("seed", LEARN_SEEDS)
def test_grpo_learns_to_call_echo_from_the_tiny_judge_alone(tmp_path, tiny_model_dir, echo_server, judge_url, seed):
    before = first_turn.evaluate(str(tiny_model_dir))
    argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
            "--env-name", "echo", "--env-urls", f"echo={echo_server.url}", "--run-name", "judged",
            "--max-steps", str(STEPS), "--save-steps", "1000", "--seed", str(seed), "--resume", "fresh",
            *judge_args(judge_url)]
    assert train.main(argv) == 0
    rows = read_metrics(tmp_path / "judged")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all("rewards/judge/mean" in r and r["judge/calls"] + r["judge/cache_hits"] > 0 for r in rows)
    assert sum(r["judge/failures"] for r in rows) == 0
    after = first_turn.evaluate(str(tmp_path / "judged" / f"checkpoint-{STEPS}"))
    print(f"[judge seed {seed}] greedy first turns on {after['prompts']} held-out rows, calling the tool / exact: "
          f"{before['tool_call_rate']:.2f} / {before['exact_rate']:.2f} before, {after['tool_call_rate']:.2f} / "
          f"{after['exact_rate']:.2f} after {STEPS} steps judged alone")
    assert before["tool_call_rate"] <= 0.2, before  # the warm start leaves the call the less likely first token
    assert after["tool_call_rate"] >= 0.6, (before, after)
    assert after["exact_rate"] >= 0.4, (before, after)
