"""#66 item 2: envs that publish their own tasks (OpenEnv 0.10's Task API) train on their tasks, learned from the
server: host-only, the fixture env `tests/fixtures/envs/sums` (written on OpenEnv's public API) served in this process.

The first test records the facts of the installed openenv that envs/generic/tasks.py depends on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from contract.config import RunConfig
from envs.core.tool import submit_final_answer
from envs.generic import GenericSpec
from envs.generic.tasks import TaskApiError, answer_tool
from envs.generic.tool import reset_text
from tests.envs.inprocess import ThreadServer
from trainer.rollouts import traces
from trainer.run.held_out import NoHeldOutRows, held_out

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "envs"


def fixture_app(name: str):
    spec = importlib.util.spec_from_file_location(f"fixture_{name}_app", FIXTURES / name / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sums():
    module = fixture_app("sums")
    with ThreadServer("sums", app=module.app) as server:
        yield server, module


def test_openenv_0_10_serves_the_task_api_as_envs_generic_tasks_reads_it():
    from importlib.metadata import version

    from openenv.core.env_server.interfaces import TaskProvider

    assert version("openenv") == "0.10.0"
    assert {"list_splits", "list_tasks", "num_tasks", "get_task", "get_task_range"} <= set(vars(TaskProvider))
    client = TestClient(fixture_app("sums").app)
    assert client.get("/list_environments").json() == ["sums"]  # create_app's env_name: the routes' prefix
    # plain strings are normalised to {"name", "type"}; a name other than train/validation/test would be "validation"
    assert client.get("/sums/splits").json() == [{"name": "train", "type": "train"}, {"name": "test", "type": "test"}]
    assert client.post("/sums/num_tasks", json={"split": "test"}).json() == {"num_tasks": 4}
    assert client.post("/sums/task", json={"split": "test", "index": 1}).json()["task"]["solution"]  # the answer
    assert client.post("/sums/task", json={"split": "test", "index": 99}).status_code == 400
    # an env class without the methods: the task routes answer 501 (its name: the class's, without env_name)
    guess = TestClient(fixture_app("guess").app)
    assert guess.get("/list_environments").json() == ["guess"]
    assert guess.get("/guess/splits").status_code == 501
    # a task is played with reset(split=..., index=...), passed through /ws as reset data
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"split": "test", "index": 1}})
        observation = ws.receive_json()["data"]["observation"]
    task = client.post("/sums/task", json={"split": "test", "index": 1}).json()["task"]
    assert observation["question"] == task["question"]


def test_a_task_api_env_trains_one_row_per_train_task_and_is_held_out_on_its_test_split(sums):
    server, module = sums
    spec = GenericSpec.discover("sums", server.url)
    assert [(s.name, s.type, s.size) for s in spec.tasks.splits] == [("train", "train", 12), ("test", "test", 4)]
    rows = spec.make_dataset(256, 0)  # DATASET_SIZE does not apply: one row per task
    assert [r["reset_kwargs"] for r in rows] == [{"split": "train", "index": i} for i in range(12)]
    assert all(r["prompt"] == [{"role": "user", "content": ""}] for r in rows)
    split, held = spec.held_out_rows(3)
    assert split == "test" and [r["reset_kwargs"]["index"] for r in held] == [0, 1, 2]
    cfg = RunConfig.load(["--env-name", "sums", "--eval-every", "2"])
    [(indices, eval_rows)] = held_out(cfg, {"sums": spec}, 3).values()
    assert indices == [0, 1, 2] and eval_rows == held
    # the user message is the task's prompt as the env's reset gives it; the answer tool ends the episode
    assert spec.answer == ("answer", "answer")
    tool = spec.tool_class(server.url)
    try:
        task = module.TASKS["train"][5]
        assert tool.reset(**rows[5]) == f"question: {task['question']}"
        assert "right" in tool.answer(answer=task["solution"]) and tool.get_reward() == 1.0
        # the model answered in plain text: the stack submits it through the answer tool, the reward is the env's
        tool.reset(**rows[5])
        name, arguments, result, failed = submit_final_answer(tool, task["solution"])
        assert (name, arguments, failed) == ("answer", {"answer": task["solution"]}, False) and tool.get_reward() == 1.0
        assert submit_final_answer(tool, "again") is None  # the episode is over: nothing more is sent
        tool.reset(**rows[5])
        assert submit_final_answer(tool, "no") and tool.get_reward() == 0.0
    finally:
        tool._client.close()


def test_env_split_picks_the_trained_split_and_a_wrong_one_is_one_line(sums):
    server, _ = sums
    spec = GenericSpec.discover("sums", server.url, split="test")
    assert {r["reset_kwargs"]["split"] for r in spec.make_dataset(8, 0)} == {"test"}
    assert spec.held_out_rows(3) is None  # the test split is trained on: nothing left to evaluate on
    with pytest.raises(NoHeldOutRows, match="no test or validation split is left"):
        held_out(RunConfig.load(["--env-name", "sums"]), {"sums": spec}, 3)
    with pytest.raises(TaskApiError) as exc:
        GenericSpec.discover("sums", server.url, split="dev")
    assert "\n" not in str(exc.value) and "train (train) 12 tasks" in str(exc.value)


def test_an_env_without_the_task_api_keeps_its_instruction_rows():
    with ThreadServer("guess", app=fixture_app("guess").app) as server:
        spec = GenericSpec.discover("guess", server.url)
    assert spec.tasks is None and spec.answer is None and spec.held_out_rows(3) is None
    rows = spec.make_dataset(3, 7)
    assert [r["reset_kwargs"] for r in rows] == [{"seed": 7}, {"seed": 8}, {"seed": 9}]


def test_a_reset_is_shown_as_its_prompt_and_never_with_a_task_spec():
    spec = {"id": "t", "problem": "What is 3+2?", "solution": "5"}
    ors = {"observation": {"metadata": {"source_type": "ors", "task_spec": spec,
                                        "prompt": [{"type": "text", "text": "What is 3+2?", "detail": None}]}}}
    assert reset_text(ors, 2000) == "What is 3+2?"
    no_prompt = {"observation": {"metadata": {"source_type": "ors", "task_spec": spec}}}
    assert "solution" not in reset_text(no_prompt, 2000) and "ors" in reset_text(no_prompt, 2000)
    fields = {"observation": {"board": "x.o", "task_spec": spec, "metadata": {"prompt": "ignored: fields come first"}}}
    assert reset_text(fields, 2000) == "board: x.o"


def test_the_answer_tool_is_one_string_argument_by_a_known_name():
    from envs.generic.interface import Param, ToolSpec

    def tool(name, *params):
        return ToolSpec(name, "", tuple(Param(p, hint, "", True, {}) for p, hint in params))

    assert answer_tool([tool("look", ("where", str)), tool("submit", ("completion", str))]) == ("submit", "completion")
    assert answer_tool([tool("answer", ("value", int))]) is None
    assert answer_tool([tool("answer", ("a", str), ("b", str))]) is None


def test_make_rollouts_shows_each_episodes_split_and_index():
    row = {"step": 1, "env": "sums", "reward": 1.0, "env_reward": 1.0, "reset": {"reset_kwargs": {"split": "train",
           "index": 3}}, "prompt": [], "turns": [], "tool_calls": []}
    assert "split train · index 3" in traces.render(row)
    assert traces.seed_groups([row, row]) == "task train[3] ×2"
    seeded = {**row, "reset": {"reset_kwargs": {"seed": 4}}}
    assert "seed 4 ·" in traces.render(seeded) and traces.seed_groups([seeded]) == "seed 4 ×1"
