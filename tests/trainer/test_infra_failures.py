"""#33 items 3 and 5: an episode the env side ended is the env's failure, not the model's.

Unit level (no server): which exceptions count as the env side's, how the binding marks an episode (a failed reset,
a lost session, a reply that never came) and what it does next, and when a failing env stops the run. The trainer
level (the real TRL trainer, the real echo server, the model's turns scripted) checks the rewards, advantages and
loss mask TRL computes for a batch with one such episode against the same batch computed by hand.
"""

from __future__ import annotations

import math

import pytest
from websockets.exceptions import ConnectionClosedError

from contract.config import CpuMode
from envs.core.client import EnvServerError, RedirectRefused
from envs.core.untrusted import UntrustedReply
from trainer.rollouts import infra_failures
from trainer.rollouts.envs_binding import ENV_UNAVAILABLE, bind
from trainer.rollouts.infra_failures import EnvDown, FailureWindow, reason
from trainer.core.metrics import RolloutStats
from trainer.core import grpo_args


@pytest.mark.parametrize("exc", [
    TimeoutError("No reply from ws://x/ws within 3 s"),
    ConnectionError("Cannot reach env server at ws://x/ws: refused"),
    ConnectionRefusedError(111, "refused"),
    ConnectionClosedError(None, None),
    EnvServerError("lost", code="SESSION_LOST"),
    EnvServerError("full", code="CAPACITY_REACHED"),
    EnvServerError("factory", code="FACTORY_ERROR"),
    UntrustedReply("a reply that is not an OpenEnv frame"),
])
def test_env_side_failures_are_infrastructure(exc):
    why = reason(exc)
    assert why and "\n" not in why


@pytest.mark.parametrize("exc", [
    EnvServerError("bad action", code="VALIDATION_ERROR"),  # the env reports a bad call: the model's
    EnvServerError("step raised", code="EXECUTION_ERROR"),
    RuntimeError("You already used the echo tool for this task."),  # a tool class's own words
    TypeError("message must be a string"),
    ValueError("Tool nope not found."),
    RedirectRefused("answered 302"),  # a setup error: it stops the run as before
])
def test_the_calls_own_failures_stay_the_models(exc):
    assert reason(exc) is None


class FlakyTool:
    """A tool class whose env fails on demand (the failure is set on the class by each test)."""

    reset_error: BaseException | None = None
    step_error: BaseException | None = None

    def __init__(self, base_url: str) -> None:
        self.calls = 0

    def reset(self, **row):
        self.calls = 0
        if FlakyTool.reset_error is not None:
            raise FlakyTool.reset_error
        return "ready"

    def act(self, move: str) -> str:
        """
        Make a move.

        Args:
            move: The move.
        """
        if FlakyTool.step_error is not None:
            raise FlakyTool.step_error
        self.calls += 1
        return f"moved {move}"

    def get_reward(self) -> float:
        return float(self.calls)


@pytest.fixture
def flaky(monkeypatch):
    monkeypatch.setattr(FlakyTool, "reset_error", None)
    monkeypatch.setattr(FlakyTool, "step_error", None)
    monkeypatch.setattr(infra_failures, "WINDOWS", FailureWindow())
    stats = RolloutStats()
    return bind("flaky", FlakyTool, "http://127.0.0.1:9", stats), stats


def test_failed_reset_is_an_infra_episode_not_the_end_of_the_run(flaky):
    cls, stats = flaky
    env = cls()
    FlakyTool.reset_error = ConnectionError("Cannot reach env server at ws://127.0.0.1:9/ws: refused")
    assert env.reset(seed=1) is None  # no raise: the prompt stays as the dataset wrote it
    assert env._infra_failure.startswith("reset failed: connection lost")
    assert env._trace.infra_failure == env._infra_failure
    FlakyTool.reset_error = None
    with pytest.raises(RuntimeError) as err:  # the model reads why; the env is not called
        env.act("a")
    assert str(err.value) == ENV_UNAVAILABLE.format(why=env._infra_failure)
    assert env.get_reward() is None  # not scored: TRL turns it into NaN
    assert stats.drain_infra_failures() == {"flaky": 1}
    assert stats.drain()[1] == {}  # not in the env's reward mean
    # the next episode is a normal one
    assert env.reset(seed=2) == "ready" and env._infra_failure is None
    assert env.act("b") == "moved b" and env.get_reward() == 1.0


def test_lost_session_mid_episode_marks_it_and_the_models_errors_do_not(flaky):
    cls, stats = flaky
    env = cls()
    env.reset()
    FlakyTool.step_error = EnvServerError("bad move", code="VALIDATION_ERROR")
    with pytest.raises(EnvServerError):
        env.act("x")
    assert env._infra_failure is None  # the env reported a bad call: the model's failure
    FlakyTool.step_error = EnvServerError("The env-server session was lost mid-episode", code="SESSION_LOST")
    with pytest.raises(EnvServerError):
        env.act("y")
    assert env._infra_failure.startswith("act: env session failed (SESSION_LOST)")
    FlakyTool.step_error = None
    with pytest.raises(RuntimeError, match="The env is unavailable"):
        env.act("z")
    assert env.get_reward() is None
    assert stats.drain_infra_failures() == {"flaky": 1}


def test_a_call_the_loop_gave_up_on_is_an_infra_episode(flaky):
    cls, _ = flaky
    env = cls()
    env.reset()
    env._abandon_session()  # what trainer.rollouts.rollout_loop does past TOOL_TIMEOUT_S
    assert env._infra_failure.startswith("no reply within TOOL_TIMEOUT_S")
    assert env._trace.infra_failure == env._infra_failure
    assert env.get_reward() is None


def test_a_late_failure_of_an_earlier_episode_does_not_mark_the_next(flaky):
    from trainer.rollouts.envs_binding import _mark_infra

    cls, _ = flaky
    env = cls()
    env.reset()
    episode = env._episode
    env.reset()
    _mark_infra(env, episode, "act: no reply")  # the earlier episode's call failing late
    assert env._infra_failure is None


def test_a_dead_env_stops_the_run_with_one_line_and_a_blip_does_not(flaky):
    cls, _ = flaky
    envs = [cls() for _ in range(8)]
    # a blip: 1 episode in 8 lost, for 64 episodes
    for round_ in range(8):
        for i, env in enumerate(envs):
            FlakyTool.reset_error = TimeoutError("no reply") if i == round_ % 8 else None
            env.reset()
            env.get_reward()
    # the env dies: every reset fails; the run stops once most of the window failed, not at the first
    FlakyTool.reset_error = ConnectionError("Cannot reach env server at ws://env-flaky:8000/ws: refused")
    stopped_after = None
    for n in range(1, 200):
        env = envs[n % 8]
        try:
            env.reset()
        except EnvDown as exc:
            stopped_after, line = n, str(exc)
            break
        env.get_reward()
    assert stopped_after is not None and stopped_after > 8, stopped_after
    assert "\n" not in line and line.startswith("env flaky: ") and "Cannot reach env server" in line


def test_failure_window_needs_enough_episodes():
    window = FailureWindow(window=10, min_episodes=4, share=0.5)
    for _ in range(3):
        window.record("e", "down")
    window.check("e", "down")  # 3 of 3, but fewer than 4 seen: no verdict
    window.record("e", "down")
    with pytest.raises(EnvDown, match="4 of its last 4"):
        window.check("e", "down")
    for _ in range(10):
        window.record("e", None)
    window.check("e", "down")  # the window moved on: 0 of the last 10


# ---------------------------------------------------------------------------- the real trainer
CALL = '<tool_call>\n{{"name": "echo_message", "arguments": {{"message": "{}"}}}}\n</tool_call>'
ANSWER = "Done."


@pytest.fixture
def scripted_trainer(tmp_path, tiny_model_dir, echo_server, monkeypatch):
    """train.py's trainer class on the real echo server; one group of 4 rollouts, each calling echo with its own
    word then answering. The 4th rollout's session is lost after its reset (closed from under it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import registry
    from contract.config import RunConfig
    from trainer.rollouts.envs_binding import build_factories
    from trainer.run.dataset import build_dataset
    from trainer.run.grpo_trainer import make_trainer_class

    monkeypatch.setattr(infra_failures, "WINDOWS", FailureWindow())
    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
                          "--env-name", "echo", "--env-urls", f"echo={echo_server.url}", "--num-generations", "4",
                          "--per-device-train-batch-size", "4", "--max-completion-length", "96",
                          "--dataset-size", "4", "--unfinished-penalty", "0.5"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    specs = {"echo": registry.get("echo")}
    dataset = build_dataset(cfg, specs)
    trainer = make_trainer_class()(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                   args=grpo_args.grpo_config(cfg.resolved(CpuMode())), train_dataset=dataset, processing_class=tokenizer,
                                   environment_factory=build_factories(cfg, specs))
    trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency)
    row = dict(dataset[0])
    target = __import__("json").loads(row["env_row"])["target"]
    words = [target, target, "wrong", target]  # rewards differ inside the group
    first = [tokenizer.encode(CALL.format(w), add_special_tokens=False) + [tokenizer.eos_token_id] for w in words]
    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    turns = []

    def scripted_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turns.append(len(prompt_ids))
        if len(turns) == 1:
            lost = trainer.environments[3]._client
            lost.close()  # its session is gone before its call (a server restart) ...
            lost._replayable = None  # ... and cannot be replayed (as after an answered step; the client's own tests)
            return [list(ids) for ids in first], None
        return [list(answer) for _ in prompt_ids], None

    trainer._generate_single_turn = scripted_turn
    return trainer, [row] * 4


def test_trainer_leaves_an_infra_episode_out_of_baseline_and_loss(scripted_trainer):
    import torch

    trainer, inputs = scripted_trainer
    trainer.model.train()  # as in a training step (the metrics go under "train")
    out = trainer._generate_and_score_completions(inputs)
    envs = trainer.environments
    assert [e._infra_failure is not None for e in envs] == [False, False, False, True]
    assert "SESSION_LOST" in envs[3]._infra_failure

    # by hand: the three scored rollouts' rewards (env reward + the penalty term, 0: each ended its turn)
    scored = torch.tensor([e._trace.env_reward for e in envs[:3]], dtype=torch.float32)
    assert scored.tolist()[0] != scored.tolist()[2], "the group needs different rewards to test the baseline"
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)  # TRL: group mean, unbiased std, + 1e-4
    advantages = out["advantages"].view(-1)
    assert torch.allclose(advantages[:3], expected, atol=1e-5), (advantages, expected)
    assert advantages[3].item() == 0.0

    # out of the loss: none of its tokens is trained, and the loss's token count is the others' alone
    trained = out["completion_mask"] * out["tool_mask"]
    assert trained[3].sum().item() == 0 and all(trained[i].sum().item() > 0 for i in range(3))
    assert int(out["num_items_in_batch"]) == int(trained.sum())
    assert trainer._metrics["train"][infra_failures.METRIC] == [1.0]
    # TRL's logged reward is the scored rollouts' mean (the infra row is NaN, left out)
    assert math.isclose(trainer._metrics["train"]["reward"][-1], scored.mean().item(), rel_tol=1e-5)
