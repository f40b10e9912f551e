"""envs/core/tool.py: the tool-instance contract. The base adds no tool, TRL sees exactly each env's tools, and the
trainer's functions read a bound instance (and any other object) without naming its private attributes."""

from __future__ import annotations

from types import SimpleNamespace

from envs.core import tool as contract
from envs.core.client import SessionClient
from envs.core.tool import EnvTool
from envs.generic import GenericSpec
from envs.generic.interface import EnvInterface, action_tool, mcp_tools
from envs.registry import get
from trainer.rollouts.envs_binding import EnvFactory, tool_method_names
from trainer.core.trl_privates import environment_pool

URL = "http://127.0.0.1:9"  # never connected: constructing a tool instance opens no session

# Each env's tools as the model must see them (what the tool class declares, nothing the base or binding adds).
EXPECTED_TOOLS = {"echo": ["echo_message", "echo_with_length"], "catch": ["move"], "wordle": ["guess"],
                  "grid_world": ["move"], "guesser": ["guess_action"]}


def learned_specs() -> dict[str, GenericSpec]:
    tools = mcp_tools([{"name": "move", "description": "Move.\n\nArgs:\n    direction: where",
                        "inputSchema": {"type": "object", "properties": {"direction": {"type": "string"}},
                                        "required": ["direction"]}}])
    action = action_tool({"title": "GuessAction", "type": "object", "description": "Guess.",
                          "properties": {"word": {"type": "string", "description": "a word"}}, "required": ["word"]})
    return {"grid_world": GenericSpec("grid_world", EnvInterface("mcp", tuple(tools))),
            "guesser": GenericSpec("guesser", EnvInterface("action", (action,)))}


def factories() -> dict[str, EnvFactory]:
    from trainer.rollouts.envs_binding import tool_class_source

    specs = {name: get(name) for name in ("echo", "catch", "wordle")} | learned_specs()
    return {name: EnvFactory(name, tool_class_source(spec), URL) for name, spec in specs.items()}


def test_the_base_adds_no_public_member():
    assert [name for name in vars(EnvTool) if not name.startswith("_")] == []
    assert tool_method_names(EnvTool) == []


def test_every_built_in_and_learned_tool_class_derives_from_the_base():
    for name, factory in factories().items():
        assert issubclass(factory.bound, EnvTool), name


def test_trl_sees_exactly_each_envs_tools(tiny_model_dir, tmp_path):
    """The real GRPOTrainer, given every env at once (a dict environment_factory), probes one bound instance of each
    and lists its tools: exactly the env's, none from EnvTool or the binding; `tool_method_names` agrees."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    bound = factories()
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "environment": name} for name in bound]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=16, report_to=[],
                      chat_template_kwargs={"enable_thinking": False})
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(
                              tiny_model_dir), environment_factory=bound)
    seen = {name: sorted(tool.__name__ for tool in tools) for name, tools in trainer._env_tools.items()}
    assert seen == EXPECTED_TOOLS
    assert {name: tool_method_names(factory.bound) for name, factory in bound.items()} == EXPECTED_TOOLS
    for pool in environment_pool(trainer).values():  # the probes hold a session client each, never connected
        for env in pool:
            assert isinstance(contract.session_of(env), SessionClient)
            contract.close_session(env)


def test_the_functions_read_a_bound_instance():
    bound = factories()
    echo, learned = bound["echo"](), bound["grid_world"]()
    assert isinstance(contract.session_of(echo), SessionClient)
    assert contract.step_rewards(echo) is None  # echo keeps no per-step rewards
    assert contract.trace_of(echo) is None and contract.infra_failure_of(echo) is None  # before its first reset
    assert contract.step_rewards(learned) == []  # a learned env keeps the rewards its server sends
    learned._record({"reward": 0.5, "done": False})
    kept = contract.step_rewards(learned)
    learned._record({"reward": 1.0, "done": True})
    assert kept == [0.5]  # a copy: what a trace took stays as it was
    snapshot = contract.detached(learned)
    assert (contract.step_rewards(snapshot), snapshot.env_name) == ([0.5, 1.0], "grid_world")
    contract.abandon_session(echo)  # the binding's hook: the episode is marked, the session closed
    assert contract.infra_failure_of(echo).startswith("no reply within TOOL_TIMEOUT_S")
    assert not contract.session_of(echo).connected
    contract.close_session(learned)


def test_the_functions_accept_any_object():
    """A custom tool class that does not derive from EnvTool, or a test double: nothing there, nothing done."""
    plain = SimpleNamespace()
    assert contract.session_of(plain) is None and contract.step_rewards(plain) is None
    assert contract.trace_of(plain) is None and contract.infra_failure_of(plain) is None
    contract.close_session(plain)
    contract.abandon_session(plain)
    contract.abandon_session(None)
    closed = []
    assert contract.session_of(SimpleNamespace(_client=SimpleNamespace(close=lambda: closed.append(1)))) is None
    contract.close_session(SimpleNamespace(_client=SimpleNamespace(close=lambda: closed.append(1))))
    assert closed == [1]


def test_the_trainer_and_benches_reach_tool_instances_only_through_the_contract():
    """No module of trainer/ or bench/ spells a tool instance's private attributes (the bound class in
    trainer/rollouts/envs_binding.py writes its own; TRL's env pool goes through trainer.core.trl_privates.environment_pool)."""
    import re

    from tests.helpers import ROOT

    names = r"_client|_rewards|_trace|_abandon_session|_infra_failure"
    reach = re.compile(rf"\"(?:{names})\"|\b(?!self\b)\w+\.(?:{names})\b|\._environment_pool\b")
    found = []
    for path in sorted((ROOT / "trainer").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py")):
        if path.name in ("envs_binding.py", "trl_privates.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if reach.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
