"""#66 item 1: evaluation during training (EVAL_EVERY, EVAL_EPISODES; trainer.run.evaluation) on a real CPU run against
a real echo server process on loopback, held to the sessions training needs: eval/<env>/... at every EVAL_EVERY-th step
beside the step's own figures, the best step kept as checkpoint-best (export takes CHECKPOINT=best), `make report`
draws it, the run prints eval's share; plus checkpoint-best's selection and keeping, unit by unit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from types import SimpleNamespace

import pytest

from contract.config import RunConfig
from trainer import train
from trainer.after import report
from trainer.core import trackers
from trainer.core.metrics import RolloutStats, read_metrics
from trainer.run import checkpoints
from trainer.run.evaluation import OVERALL, SECONDS, EvalCallback, figures, my_share, overall
from trainer.run.held_out import EVAL_SEED_BASE, Episode, NoHeldOutRows, held_out

BATCH = 4  # PER_DEVICE_TRAIN_BATCH_SIZE = NUM_GENERATIONS: one group a step, four env sessions
EPISODES = 6  # more than a batch: the evaluation plays two batches on the training sessions


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, tiny_model_dir):
    """4 steps, an evaluation at steps 2 and 4, against an echo server that holds exactly the sessions training opens:
    an evaluation that opened one more would have episodes ended by the env side (CAPACITY_REACHED). A checkpoint
    every step: transformers' rotation (3 kept, oldest by mtime first) must leave checkpoint-best alone."""
    from tests.trainer.conftest import EnvServer

    server = EnvServer("echo", capacity=BATCH)
    out = tmp_path_factory.mktemp("evaluated")
    argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(out),
            "--env-urls", f"echo={server.url}", "--run-name", "ev", "--max-steps", "4", "--save-steps", "1",
            "--per-device-train-batch-size", str(BATCH), "--num-generations", str(BATCH),
            "--max-completion-length", "64", "--trace-every", "0", "--eval-every", "2", "--eval-episodes", str(EPISODES)]
    printed = io.StringIO()  # what the run prints (capsys is per test; the run is the module's)
    try:
        with contextlib.redirect_stdout(printed):
            code = train.main(argv)
    finally:
        sessions_left = server.health()["active_sessions"]
        server.stop()
    print(printed.getvalue())  # for a failure's report
    assert code == 0
    return SimpleNamespace(run_dir=out / "ev", printed=printed.getvalue(), sessions_left=sessions_left)


def test_eval_points_land_every_eval_every_steps_beside_the_steps_own_figures(evaluated_run):
    rows = read_metrics(evaluated_run.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        has_eval = row["step"] % 2 == 0
        assert (f"eval/echo/reward_mean" in row) == has_eval and (OVERALL in row) == has_eval, row
        # the step's own episodes only: the evaluation's went to an account set apart
        assert row["env/echo/episodes"] == BATCH, row
    for row in (r for r in rows if r["step"] % 2 == 0):
        assert row["eval/echo/episodes"] == EPISODES and row["eval/echo/infra_failures"] == 0, row
        assert row[OVERALL] == row["eval/echo/reward_mean"]  # one env: its reward is the run's
        assert 0.0 <= row["eval/echo/success_rate"] <= 1.0 and row[SECONDS] > 0
        assert row["eval/echo/tokens_per_episode"] > 0
    assert evaluated_run.sessions_left == 0  # every session closed at the end, the evaluation's included


def test_the_best_step_is_kept_as_checkpoint_best_and_export_takes_it(evaluated_run):
    rows = [r for r in read_metrics(evaluated_run.run_dir) if OVERALL in r]
    best_step = max(rows, key=lambda r: (r[OVERALL], -r["step"]))["step"]  # the first of equal rewards stays best
    path, step = checkpoints.pick(evaluated_run.run_dir, "best")
    assert path.name == "checkpoint-best" and step == best_step
    note = checkpoints.best_note(evaluated_run.run_dir)
    assert note["step"] == best_step and note["reward"] == pytest.approx(max(r[OVERALL] for r in rows))
    assert (path / "model.safetensors").exists() and not list(path.glob("rng_state*"))
    assert checkpoints.last_complete(evaluated_run.run_dir)[1] == 4  # resume still takes the numbered ones
    assert len(checkpoints.numbered(evaluated_run.run_dir)) < 4  # the rotation ran, and left checkpoint-best


def test_the_run_prints_each_evaluation_and_its_share_of_the_time(evaluated_run):
    assert re.search(r"\[train\] eval at step 2: echo reward -?\d\.\d{3} success \d+% tool calls/ep \d\.\d\d "
                     rf"\({EPISODES} episodes\), greedy, held out", evaluated_run.printed), evaluated_run.printed
    assert re.search(r"\[train\] eval: 2 evaluation\(s\) took \d+\.\d s of the run's \d+\.\d s \(\d+%\): the run took "
                     r"\d\.\d\dx its time without them; best eval reward", evaluated_run.printed)
    assert "eval every 2 steps: 6 held-out episodes per env" in evaluated_run.printed  # preflight's line


def test_make_report_draws_the_eval_curve_beside_the_training_one(evaluated_run, tmp_path):
    rows = read_metrics(evaluated_run.run_dir)
    lines = report.summarize(rows)
    assert any(line.startswith("eval echo (held-out episodes, greedy): reward") for line in lines), lines
    assert any(line.startswith("eval: 2 evaluations") for line in lines), lines
    report.plot(rows, tmp_path / "r.png", "ev")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_every_tracker_gets_the_eval_keys_as_they_are(evaluated_run):
    row = next(r for r in read_metrics(evaluated_run.run_dir) if r["step"] == 2)
    view = trackers.view(row)
    assert view["eval/echo/reward_mean"] == row["eval/echo/reward_mean"] and view[OVERALL] == row[OVERALL]
    assert view["time/eval_s"] == row[SECONDS] and not any(k.startswith("trl/eval") for k in view)


# ---------------------------------------------------------------------------- units
class ScriptedEvaluation(EvalCallback):
    """The callback with its episodes replaced by a script of eval rewards (a stand-in for playing them)."""

    def __init__(self, run_dir, rewards):
        cfg = RunConfig.load(["--output-dir", str(run_dir.parent), "--run-name", run_dir.name, "--eval-every", "2"])
        super().__init__(cfg, {}, RolloutStats(), print_fn=lambda line: None)
        self.rewards, self.trainer = list(rewards), object()

    def evaluate(self):
        return figures("echo", [Episode(0, self.rewards.pop(0), 1, 0, 5)])


def fake_checkpoint(run_dir, step):
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * step)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "rng_state_0.pth").write_bytes(b"r")
    checkpoints.seal(folder, step)
    return folder


def test_a_better_eval_reward_asks_for_a_save_and_becomes_checkpoint_best_with_scripted_rewards(tmp_path):
    run_dir = tmp_path / "run"
    callback = ScriptedEvaluation(run_dir, [0.2, 0.1, 0.5, 0.5])
    args = SimpleNamespace(output_dir=str(run_dir))
    wanted = []
    for step in (1, 2, 4, 6, 8):  # step 1 is not an EVAL_EVERY=2 step
        state = SimpleNamespace(global_step=step, is_world_process_zero=True, best_model_checkpoint=None)
        control = SimpleNamespace(should_save=False, should_log=False)
        callback.on_step_end(args, state, control)
        wanted.append((step, control.should_save, control.should_log))
        if control.should_save:
            fake_checkpoint(run_dir, step)
            callback.on_save(args, state, control)
            assert state.best_model_checkpoint == str(run_dir / "checkpoint-best")  # transformers' rotation spares it
    # 0.2 first best, 0.1 worse, 0.5 better, 0.5 again not better: the earlier checkpoint stays the best
    assert wanted == [(1, False, False), (2, True, True), (4, False, True), (6, True, True), (8, False, True)]
    assert checkpoints.pick(run_dir, "best")[1] == 6 and checkpoints.best_note(run_dir) == {"step": 6, "reward": 0.5}
    assert callback.stats.drain_figures()[OVERALL] == 0.5  # the last evaluation's figures, for its step's record
    resumed = ScriptedEvaluation(run_dir, [0.4])  # a resumed run competes with the best it kept
    control = SimpleNamespace(should_save=False, should_log=False)
    resumed.on_step_end(args, SimpleNamespace(global_step=10, is_world_process_zero=True), control)
    assert not control.should_save


def test_checkpoint_best_outlives_the_rotation_of_the_checkpoint_it_came_from(tmp_path):
    run_dir = tmp_path / "run"
    first = fake_checkpoint(run_dir, 3)
    best = checkpoints.keep_as_best(first, 3, {"step": 3, "reward": 0.1})
    assert os.stat(best / "model.safetensors").st_ino == os.stat(first / "model.safetensors").st_ino  # no copy
    assert not (best / "rng_state_0.pth").exists() and checkpoints.is_complete(best)
    second = fake_checkpoint(run_dir, 5)
    checkpoints.keep_as_best(second, 5, {"step": 5, "reward": 0.3})
    import shutil

    shutil.rmtree(second)  # TRL's save_total_limit rotation
    path, step = checkpoints.pick(run_dir, "best")
    assert step == 5 and (path / "model.safetensors").read_bytes() == b"w" * 5
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-3", "checkpoint-best"]  # no temp folder left
    with pytest.raises(checkpoints.CheckpointError, match="EVAL_EVERY"):
        checkpoints.pick(tmp_path / "other", "best")


def test_figures_leave_out_what_the_env_side_ended_and_overall_is_the_envs_mean():
    episodes = [Episode(0, 1.0, 1, 0, 10), Episode(1, 0.2, 2, 1, 20), Episode(2, 0.0, 0, 0, 5, "server gone")]
    out = figures("echo", episodes)
    assert out["eval/echo/episodes"] == 2 and out["eval/echo/infra_failures"] == 1
    assert out["eval/echo/reward_mean"] == pytest.approx(0.6) and out["eval/echo/success_rate"] == 0.5
    assert out["eval/echo/tool_calls_per_episode"] == 1.5 and out["eval/echo/tokens_per_episode"] == 15
    lost = figures("catch", [Episode(0, 0.0, 0, 0, 0, "gone")])
    assert "eval/catch/reward_mean" not in lost
    assert overall({**out, **lost}) == pytest.approx(0.6) and overall(lost) is None


def test_each_process_plays_its_share_padded_to_the_same_count():
    rows = [{"i": i} for i in range(5)]
    assert my_share(rows, 0, 2) == ([{"i": 0}, {"i": 2}, {"i": 4}], 3)
    assert my_share(rows, 1, 2) == ([{"i": 1}, {"i": 3}, {"i": 0}], 2)  # padded; the pad's episode is dropped
    assert my_share(rows, 0, 1) == (rows, 5)


def test_held_out_seeds_are_never_training_seeds_and_a_prompts_file_env_is_refused_in_one_line():
    from envs import registry

    cfg = RunConfig.load(["--env-name", "echo", "--eval-every", "5"])
    [(seeds, rows)] = held_out(cfg, {"echo": registry.get("echo")}, 3).values()
    assert seeds == [EVAL_SEED_BASE, EVAL_SEED_BASE + 1, EVAL_SEED_BASE + 2] and len(rows) == 3
    with pytest.raises(NoHeldOutRows) as exc:
        held_out(cfg, {"echo": SimpleNamespace(prompts_file="/prompts/p.jsonl")}, 3)
    assert "\n" not in str(exc.value) and "EVAL_EVERY" in str(exc.value)


def test_eval_every_with_async_rollouts_is_accepted_and_sized():
    """(It was refused in one line before the async evaluation: tests/trainer/test_async_eval.py.)"""
    cfg = RunConfig.load(["--rollouts", "async", "--train-mode", "gpu", "--eval-every", "10"])
    assert cfg.rollouts.is_async and cfg.rollouts.eval_every == 10 and cfg.rollouts.eval_sessions(cfg) > 0
    assert RunConfig.load(["--rollouts", "async", "--train-mode", "gpu", "--eval-every", "0"]).rollouts.is_async
