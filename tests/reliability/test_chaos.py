"""`make chaos`, short (#33 items 1, 2), sync (and async, the second test): a real CPU training run against 2 env-echo
replicas of the real compose.yaml while bench/chaos.py's seeded injector, by step (#63 item 8), kills and stops their
servers, drops, half-opens, delays and floods with control frames the trainer's connections through its proxy, and
kills the trainer once mid-step, which is then resumed.

What must hold whatever the faults' timing: no reply reaches the wrong request, every step is trained once (none
lost or repeated across the kill; the last checkpoint is at MAX_STEPS), every fault kind planned was injected,
episodes lost to infrastructure are counted, every stall ended within its bound, and no server holds a session slot
once the trainer is gone. The 1 % share is the full bench's goal, not asserted here (a short run is all faults).
Whether a hostile frame burst ended its session is the client's (its control-frame bound), printed, not asserted.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import build_images
from tests.reliability.common import report

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def holds_whatever_the_timing(f: dict, args) -> None:
    """The figures' goals a short run meets at any timing of its faults, and nothing of the run left behind: its env
    replicas, its proxy and (async) the rehearsal's containers, the restarted twin among them."""
    for label in (f"label=com.docker.compose.project={args.project}",
                  f"label=com.docker.compose.project={args.project}-rehearse", f"name=^{args.project}-proxy$"):
        left = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True,
                              check=True).stdout
        assert left.split() == [], f"containers left behind ({label})"
    assert f["calls_checked"] > 0, "no tool call was checked: the run called no tool"
    missing = {k: (f["faults"][k], n) for k, n in f["faults_planned"].items() if f["faults"][k] < n}
    assert not missing, f"fault kinds injected fewer times than planned (injected, planned): {missing}"
    assert f["replies_paired_wrong"] == 0
    assert f["steps_lost"] == [] and f["steps_repeated"] == [], (f["steps_lost"], f["steps_repeated"])
    assert f["final_global_step"] == args.steps
    assert isinstance(f["infra_failures"], int) and f["episodes"] > 0
    assert sum(f["slots_held_at_end"]["held"].values()) == 0, f["slots_held_at_end"]
    assert all(s["within"] for s in f["stalls"]), f["stalls"]


def same_model(tiny_model_dir) -> list[str]:
    """The session's tiny model as the bench's model cache (bench/chaos.py finds it complete, makes none)."""
    return ["--model-cache", str(tiny_model_dir.parent)] if tiny_model_dir.name == "tiny-qwen3" else []


def test_short_chaos_run_keeps_its_figures(docker, tmp_path, tiny_model_dir):
    from bench import chaos

    build_images("env-server")
    args = chaos.parse_args(["--steps", "6", "--replicas", "2", "--per-kind", "1", "--kill-after", "3", "--seed", "3",
                             "--out", str(tmp_path / "chaos"), "--project", "grpo-test-chaos-ci",
                             "--guard-s", "1800", *same_model(tiny_model_dir)])
    f = chaos.run(args)
    holds_whatever_the_timing(f, args)
    report(f"chaos (short): {f['faults']}, trainer killed after step {f['trainer_kill'][0]['after_step']}; "
           f"{f['calls_checked']} replies checked, 0 paired wrong; {f['infra_failures']} of {f['episodes']} episodes "
           f"lost to infrastructure; 0 steps lost or repeated; 0 slots held "
           f"{f['slots_held_at_end']['after_s']:.0f} s after exit; {len(f['stalls'])} stalls within bound "
           f"({sum(1 for s in f['stalls'] if s['diagnosis'])} of {sum(1 for s in f['stalls'] if s['waited'])} "
           f"waited on with a diagnosis line); {f['replayed']} episodes saved by a replayed reset")


@pytest.mark.twin  # make rehearse: the vLLM CPU twin
def test_short_async_chaos_run_rides_out_a_vllm_restart(docker, tmp_path, tiny_model_dir):
    """The same injector and figures on `make rehearse` with ROLLOUTS=async (TRL's AsyncGRPOTrainer on the vLLM CPU
    twin, the proxy in a container on the trainer's envnet), plus the twin killed once mid-run: make rehearse stops the
    trainer (exit 77), recreates the twin and resumes from a checkpoint. What must hold whatever the timing, as the sync
    test, and the recovery. No trainer kill here (the bench has one): the sync test kills its trainer, and the resume
    after the twin's restart is the same stop-and-resume, checked the same way (no step lost or repeated)."""
    from bench import chaos
    from tests.gpu_path.conftest import ensure_trainer_standin_image

    build_images("env-server")
    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    # 6 steps, the twin killed after step 2 (the env faults after the resume, chaos_faults.plan): steps left for the
    # trainer to meet the dead twin (an async step can end within a second of the one before, and the driver reads the
    # step records by docker exec on a busy machine) and for the env faults to fire
    args = chaos.parse_args(["--rollouts", "async", "--steps", "6", "--replicas", "2", "--per-kind", "1",
                             "--vllm-restart-after", "2", "--kill-after", "0", "--vllm-bound-s", "240", "--seed", "3",
                             "--out", str(tmp_path / "chaos"), "--project", "grpo-test-chaos-async-ci",
                             "--guard-s", "1800", *same_model(tiny_model_dir)])
    f = chaos.run(args)
    holds_whatever_the_timing(f, args)
    v = f["vllm_restart"]
    assert v and v["trainer_stopped"] and v["restarted"], v
    assert v["resumed_from"] is not None and v["resumed_from"] <= v["after_step"], v
    report(f"chaos (short, async): {f['faults']}, twin killed after step {v['after_step']} and the run resumed from "
           f"checkpoint-{v['resumed_from']}; "
           f"{f['calls_checked']} replies checked, 0 paired wrong; {f['infra_failures']} of {f['episodes']} episodes "
           f"lost to infrastructure; 0 steps lost or repeated; {len(f['stalls'])} stalls within bound")
