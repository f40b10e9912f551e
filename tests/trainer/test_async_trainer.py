"""ROLLOUTS=async without Docker: the layouts it refuses (one line each), everything it hands TRL's spawned rollout
worker pickles and rebuilds in a fresh process (every env kind's factory, the reward functions, the stack's rollout
loop), and the TRL privates trainer/async_grpo/async_trainer.py relies on still exist. The run itself:
tests/gpu_path/test_server_mode_rehearsal.py and test_rehearse_command.py."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from envs.echo.tool import EchoTool
from envs.generic import GenericSpec
from envs.generic.interface import EnvInterface, action_tool, mcp_tools
from envs.registry import get
from tests.helpers import ROOT
from contract.config import ConfigError, CpuMode, GpuMode, RunConfig
from trainer.rollouts.envs_binding import EnvFactory, build_factories
from trainer.rollouts.rewards import unfinished_penalty


def refusal(**settings) -> str:
    with pytest.raises(ConfigError) as exc:
        RunConfig.load([], rollouts="async", **settings)
    return str(exc.value)


@pytest.mark.parametrize("settings, says", [
    ({"train_mode": "cpu"}, "`make rehearse`"),
    ({"train_mode": "colocate"}, "TRAIN_MODE=gpu on 2+ GPUs"),
    ({"train_mode": "gpu", "trainer_processes": 3, "trainer_sharding": "fsdp"}, "huggingface/trl#6797"),
    ({"train_mode": "gpu", "trainer_processes": 2}, "TRAINER_SHARDING=fsdp"),
    ({"train_mode": "gpu", "trainer_processes": 2, "trainer_sharding": "zero3"}, "TRAINER_SHARDING=fsdp"),
])
def test_a_layout_async_cannot_run_is_refused_in_one_line_naming_the_fix(settings, says):
    message = refusal(**settings)
    assert "\n" not in message and message.startswith("ROLLOUTS=async") and says in message, message
    assert "edit .env" in message


@pytest.mark.parametrize("processes, sharding", [(None, "ddp"), (1, "ddp"), (2, "fsdp")])
def test_the_layouts_async_runs_are_accepted(processes, sharding):
    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", trainer_processes=processes, trainer_sharding=sharding)
    assert cfg.resolved(GpuMode()).rollouts_problem(processes or 1) is None


def test_auto_is_checked_once_resolved_by_the_launcher():
    cfg = RunConfig.load([], rollouts="async")  # TRAIN_MODE=auto: the host cannot tell yet
    assert "`make rehearse`" in cfg.resolved(CpuMode()).rollouts_problem(1)
    assert "huggingface/trl#6797" in cfg.resolved(GpuMode()).rollouts_problem(4)
    assert RunConfig.load([]).resolved(CpuMode()).rollouts_problem(8) is None  # sync: nothing to refuse


def test_async_counts_the_sessions_of_its_rollouts_in_flight():
    cfg = RunConfig.load([], rollouts="async", max_staleness=3, per_device_train_batch_size=8)
    assert cfg.sessions_needed("echo", num_processes=2) == 3 * 8 * 2  # one worker, on rank 0, for both processes


def test_max_inflight_rollouts_reaches_trls_worker_and_the_session_count():
    """MAX_INFLIGHT_ROLLOUTS is TRL's max_inflight_tasks; the env sessions counted (preflight, auto replicas) follow
    it; empty keeps TRL's default (-1: max(MAX_STALENESS, 1) x the samples of one step, the count sessions use)."""
    from trainer.async_grpo.async_trainer import build_async_config

    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="reload", max_staleness=3,
                         per_device_train_batch_size=8, max_inflight_rollouts=6)
    assert build_async_config(cfg.resolved(GpuMode())).max_inflight_tasks == 6
    assert cfg.sessions_needed("echo", num_processes=2) == 6
    assert cfg.rollouts.inflight_rule(cfg) == "ROLLOUTS=async: MAX_INFLIGHT_ROLLOUTS 6"
    default = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="reload")
    assert build_async_config(default.resolved(GpuMode())).max_inflight_tasks == -1
    assert "MAX_STALENESS 4 x PER_DEVICE_TRAIN_BATCH_SIZE" in default.rollouts.inflight_rule(default)
    with pytest.raises(ConfigError, match="MAX_INFLIGHT_ROLLOUTS=6 is a setting of ROLLOUTS=async"):
        RunConfig.load([], rollouts="sync", max_inflight_rollouts=6)


def generic_spec() -> GenericSpec:
    """An env learned from its server (no server here: the interface as discover() would return it), with the
    argument kinds JSON schemas bring: enums, arrays, optional fields."""
    tools = mcp_tools([{"name": "move", "description": "Move.\n\nArgs:\n    direction: where\n    steps: how far",
                        "input_schema": {"properties": {"direction": {"enum": ["left", "right"]},
                                                        "steps": {"type": "integer"},
                                                        "marks": {"type": "array", "items": {"type": "string"}}},
                                         "required": ["direction"]}}])
    mcp = GenericSpec("grid_world", EnvInterface("mcp", tuple(tools)))
    action = action_tool({"title": "GuessAction", "type": "object",
                          "properties": {"guess": {"type": "string", "description": "a word"}}, "required": ["guess"]})
    return mcp, GenericSpec("guesser", EnvInterface("action", (action,)))


def factories(cfg_envs: str, specs: dict):
    urls = ",".join(f"{name}=http://127.0.0.1:9" for name in specs)
    cfg = RunConfig.load([], env_name=cfg_envs, env_urls=urls)
    return build_factories(cfg, specs)


REBUILD = """
import pickle, sys
from trainer.rollouts.envs_binding import tool_method_names
loaded = pickle.loads(sys.stdin.buffer.read())
for name, factory in (loaded.items() if isinstance(loaded, dict) else [(None, loaded)]):
    cls = factory.bound
    assert cls is factory.bound  # one class per process: TRL keys env rewards by it
    print(name, factory.env_name, cls.__name__, ",".join(tool_method_names(cls)), callable(cls.get_reward),
          factory.url, factory.stats is __import__("trainer.core.metrics").core.metrics.STATS)
"""


def rebuilt_in_a_fresh_process(obj) -> list[str]:
    """What a spawned process (TRL's rollout worker) makes of `obj`: unpickled and bound there, nothing shared."""
    out = subprocess.run([sys.executable, "-c", REBUILD], input=pickle.dumps(obj), capture_output=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return out.stdout.decode().split("\n")[:-1]


def test_a_built_in_envs_factory_pickles_and_binds_in_a_fresh_process():
    factory = factories("echo", {"echo": get("echo")})
    assert isinstance(factory, EnvFactory)
    assert rebuilt_in_a_fresh_process(factory) == [
        "None echo EchoTool echo_message,echo_with_length True http://127.0.0.1:9 True"]


def test_a_learned_envs_factory_pickles_and_rebuilds_its_tool_class_in_a_fresh_process():
    mcp, action = generic_spec()
    factory = factories("grid_world", {"grid_world": mcp})
    expected = factory.bound  # the class this process builds: the other must build the same surface
    assert rebuilt_in_a_fresh_process(factory) == [
        f"None grid_world {expected.__name__} move True http://127.0.0.1:9 True"]
    action_factory = factories("guesser", {"guesser": action})
    assert rebuilt_in_a_fresh_process(action_factory)[0].split()[3] == "guess_action"


def test_a_multi_env_dict_of_factories_pickles_whole():
    mcp, _ = generic_spec()
    bound = factories("echo,grid_world", {"echo": get("echo"), "grid_world": mcp})
    lines = rebuilt_in_a_fresh_process(bound)
    assert [line.split()[:4] for line in lines] == [["echo", "echo", "EchoTool", "echo_message,echo_with_length"],
                                                   ["grid_world", "grid_world", "GridWorldTool", "move"]]


def test_a_factory_keeps_binding_in_place_for_the_sync_trainer():
    factory = factories("echo", {"echo": get("echo")})
    assert issubclass(factory.bound, EchoTool) and factory.replica_set is factory.bound.replica_set
    clone = pickle.loads(pickle.dumps(factory))
    assert clone.bound is not factory.bound and clone.url == factory.url  # rebuilt, never carried across


def test_the_reward_functions_pickle_and_keep_their_name():
    from trl.trainer.utils import get_callable_name

    reward = pickle.loads(pickle.dumps(unfinished_penalty(1.5, frozenset({7}))))
    assert get_callable_name(reward) == "unfinished"  # rewards/unfinished/mean in both modes
    assert reward(completion_ids=[[1, 7], [1, 2], []]) == [0.0, -1.5, 0.0]


def test_the_stack_rollout_loop_and_reload_transfer_pickle_by_name():
    from trainer.async_grpo import async_trainer

    assert pickle.loads(pickle.dumps(async_trainer.StackRolloutLoop)) is async_trainer.StackRolloutLoop
    transfer = async_trainer.ReloadWeightTransfer("http://vllm:8000", "/weights", 30.0, "bfloat16")
    assert pickle.loads(pickle.dumps(transfer)).folder == "/weights"


def test_the_async_config_carries_the_sync_settings():
    from trainer.async_grpo.async_trainer import build_async_config

    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="reload", max_staleness=2,
                         max_steps=7, num_generations=4, per_device_train_batch_size=8, tool_timeout_s=9)
    args = build_async_config(cfg.resolved(GpuMode()))
    assert (args.max_staleness, args.max_steps, args.num_generations, args.per_device_train_batch_size) == (2, 7, 4, 8)
    assert args.vllm_server_base_url == cfg.vllm_server_url and args.dtype == "float32"
    assert args.use_cpu and not args.bf16  # the rehearsal trains on CPU
    assert args.chat_template_kwargs == {"enable_thinking": False}
    assert args.token_budget is None  # ASYNC_STEP_SAMPLES=packed: TRL fills in vLLM's max_model_len


def test_async_step_samples_batch_trains_a_sync_steps_count():
    """ASYNC_STEP_SAMPLES=batch: TRL's fixed-count batcher (token_budget 0), per_device_train_batch_size x
    gradient_accumulation_steps x processes samples a step, as a sync step; refused with ROLLOUTS=sync."""
    from trainer.async_grpo.async_trainer import build_async_config

    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="reload", async_step_samples="batch")
    assert build_async_config(cfg.resolved(GpuMode())).token_budget == 0
    with pytest.raises(ConfigError, match="ASYNC_STEP_SAMPLES=batch is a setting of ROLLOUTS=async"):
        RunConfig.load([], rollouts="sync", async_step_samples="batch")


class SlowEnv:
    """A bound env's surface as the rollout worker sees it: a tool that never returns until released."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.abandoned = 0

    def wait_forever(self, x: int) -> str:
        """Block.

        Args:
            x: ignored
        """
        self.release.wait(60)
        return "late"

    def quick(self, x: int) -> str:
        """Answer.

        Args:
            x: echoed
        """
        return f"got {x}"

    def _abandon_session(self) -> None:
        self.abandoned += 1


def stack_loop(tool_timeout_s: float):
    """StackRolloutLoop with only what `_execute_tool_calls` reads (TRL's counters, rates and tool pool)."""
    from collections import defaultdict
    from concurrent.futures import ThreadPoolExecutor

    from trainer.async_grpo.async_trainer import StackRolloutLoop

    loop = object.__new__(StackRolloutLoop)
    loop.tool_timeout_s, loop._tool_pool = tool_timeout_s, ThreadPoolExecutor(4)
    loop._counters, loop._rates = defaultdict(float), defaultdict(lambda: [0.0, 0.0])
    return loop


def test_a_tool_call_past_tool_timeout_s_fails_with_the_sync_message_and_closes_the_session():
    import asyncio

    from trainer.rollouts.rollout_loop import TIMEOUT_ERROR

    env, loop = SlowEnv(), stack_loop(0.2)
    calls = [{"function": {"name": "wait_forever", "arguments": {"x": 1}}},
             {"function": {"name": "quick", "arguments": {"x": 2}}}]
    try:
        messages, n_calls, n_failures = asyncio.run(
            loop._execute_tool_calls(calls, {"wait_forever": env.wait_forever, "quick": env.quick}))
    finally:
        env.release.set()
        loop._tool_pool.shutdown(wait=True)
    assert (n_calls, n_failures, env.abandoned) == (2, 1, 1)
    assert TIMEOUT_ERROR.format(name="wait_forever", seconds=0.2) in messages[0]["content"]
    assert messages[1]["content"] == "got 2"  # TRL's loop went on with the turn's next call


# ---------------------------------------------------------------------------------------------- the pin
# The TRL sources trainer/async_grpo/async_trainer.py relies on are pinned in trainer/core/trl_privates.py (tests/trainer/test_trl_privates.py).


def test_lora_async_unloads_the_policy_adapters_an_earlier_run_left_in_vllm(monkeypatch, capsys):
    """A fresh run numbers its adapters from v1 again; vLLM refuses a name it holds (400), so the earlier run's go."""
    import requests

    from trainer.async_grpo.async_trainer import _unload_earlier_adapters

    held = ["/models/base", "trl-policy-v3", "trl-policy-v4", "my-own-adapter"]
    unloaded = []

    class Answer:
        def json(self):
            return {"data": [{"id": name} for name in held]}

    monkeypatch.setattr(requests, "get", lambda url, timeout: Answer())
    monkeypatch.setattr(requests, "post", lambda url, json, timeout: unloaded.append((url, json["lora_name"])))
    _unload_earlier_adapters("http://vllm:8000/", "trl-policy-v")
    assert unloaded == [("http://vllm:8000/v1/unload_lora_adapter", "trl-policy-v3"),
                        ("http://vllm:8000/v1/unload_lora_adapter", "trl-policy-v4")]
    assert "unloaded 2 adapter(s) an earlier run left in vLLM" in capsys.readouterr().out
