"""Several trainer processes stay in step through the tool loop (trainer.rollouts.rollout_loop), on 2 CPU processes (gloo).

Test double for the GPU-only step: generation goes through TRL's own server-mode collective with the vLLM
server replaced by a script (tests/trainer/server_mode_ranks.py), because that collective is what breaks when
ranks disagree: a rank that needs fewer tool rounds than another would leave it waiting in `gather_object`, and
ranks sending different prompt counts would take slices holding another rank's completions. The rest is the
real `trainer.train` on the real echo server. The script makes each prompt's word decide its rollout's tool
rounds (0 to 3), so the two ranks differ in rounds and in tool-calling rollouts on the same step.
"""

from __future__ import annotations

import json
import os
import subprocess

from contract.config import CpuMode
from tests.helpers import ROOT, free_port

MAX_STEPS = 4


def test_two_ranks_server_mode_double_stay_in_step_and_keep_their_own_samples(echo_server, tiny_model_dir, tmp_path):
    from trainer.launch import launch_argv
    from trainer.core.metrics import read_metrics

    args = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"),
            "--run-name", "ranks", "--resume", "fresh", "--env-name", "echo", "--env-urls", f"echo={echo_server.url}",
            "--num-generations", "2", "--per-device-train-batch-size", "4", "--max-steps", str(MAX_STEPS),
            "--save-steps", "100", "--dataset-size", "32"]
    argv = launch_argv(2, CpuMode(), "ddp", args, port=free_port())
    at = argv.index("trainer.train") - 1  # "-m trainer.train" -> the script that wraps it
    argv[at:at + 2] = [str(ROOT / "tests" / "trainer" / "server_mode_ranks.py")]
    env = {"RANK_LOG_DIR": str(tmp_path), "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    rows = read_metrics(tmp_path / "out" / "ranks")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "a step was lost or logged twice"

    ranks = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == MAX_STEPS
    for zero, one in zip(*ranks):
        assert zero["generations"] == one["generations"], "the ranks ran different numbers of generation rounds"
        assert zero["foreign_turns"] == one["foreign_turns"] == 0, "a rank received another rank's completions"
    # The prompt set did what it is there for: on some step the ranks needed different rounds and prompt counts.
    assert any(z["tool_rounds_needed"] != o["tool_rounds_needed"] for z, o in zip(*ranks)), ranks
    assert any(z["tool_calling"] != o["tool_calling"] for z, o in zip(*ranks)), ranks
