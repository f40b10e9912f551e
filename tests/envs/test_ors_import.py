"""#66 item 3: an env written on the `openreward` SDK's public API (tests/fixtures/envs/ors_arith/source, the layout
`orwd init` makes: 64 train and 16 test tasks, one `answer` tool), imported with the real `openenv import --type ors`
(the openenv 0.10.0 CLI), and what the import produced served in this process and learned by the generic path: the
stack trains on its train split, shows the task's prompt and never its spec (which holds the solution), and scores a
plain-text final answer through the `answer` tool. Host-only; what the import needs is recorded in the first test."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from envs.core.tool import submit_final_answer
from envs.generic import GenericSpec
from tests.envs.inprocess import ThreadServer

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "ors_arith" / "source"
NAME = "ors_arith"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The package `openenv import --type ors` writes, imported and served (uvicorn in a thread)."""
    out = tmp_path_factory.mktemp("ors-import")
    done = subprocess.run([sys.executable, "-m", "openenv.cli", "import", str(SOURCE), "--name", NAME,
                           "--output-dir", str(out), "--type", "ors"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    package = out / NAME
    sys.path.insert(0, str(out))
    try:
        from ors_arith.server import app as app_module  # noqa: E402 - the generated package
        with ThreadServer(NAME, app=app_module.app) as server:
            yield package, app_module, server
    finally:
        sys.path.remove(str(out))
        for module in [m for m in sys.modules if m == NAME or m.startswith(f"{NAME}.")]:
            del sys.modules[module]


def test_what_the_import_needs_and_lays_out(imported):
    package, app_module, _ = imported
    # versions that install together (pyproject's test extra): the CLI's openenv and the SDK the source imports
    assert version("openenv") == "0.10.0" and version("openreward") == "0.1.167"
    requirements = (package / "server" / "requirements.txt").read_text().split()
    assert "openreward==0.1.167" in requirements  # the source's own pin, carried over
    for path in ("server/app.py", f"server/{NAME}_environment.py", "server/Dockerfile", "openenv.yaml",
                 "vendor/source/server.py"):
        assert (package / path).is_file(), path
    # one session per container (create_app's max_concurrent_envs=1, SUPPORTS_CONCURRENT_SESSIONS False): the stack's
    # capacity probe and ENV_<NAME>_REPLICAS=auto size it; the task routes answer under the import's name
    assert app_module.app is not None and "max_concurrent_envs=1" in (package / "server" / "app.py").read_text()


def test_the_wrappers_reset_carries_the_task_spec_and_its_prompt(imported):
    """The facts the generic tool's reset text depends on (envs.generic.tool.reset_text)."""
    from starlette.testclient import TestClient

    _, app_module, _ = imported
    client = TestClient(app_module.app)
    assert client.get("/list_environments").json() == [NAME]
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"split": "test", "index": 2}})
        data = ws.receive_json()["data"]
    metadata = data["observation"]["metadata"]
    assert set(data["observation"]) == {"metadata"}  # a bare Observation: no field of its own
    assert metadata["task_spec"]["solution"] and metadata["prompt"][0]["type"] == "text"
    assert metadata["prompt"][0]["text"] == metadata["task_spec"]["problem"]


def test_the_imported_env_trains_on_its_tasks_through_the_generic_path(imported):
    package, _, server = imported
    import importlib.util

    found = importlib.util.spec_from_file_location("ors_arith_source", SOURCE / "server.py")
    source = importlib.util.module_from_spec(found)  # the ORS source itself: the solutions to check against
    found.loader.exec_module(source)
    spec = GenericSpec.discover(NAME, server.url)
    assert [(s.name, s.size) for s in spec.tasks.splits] == [("train", 64), ("test", 16)]
    assert spec.answer == ("answer", "answer") and [t.name for t in spec.interface.tools] == ["answer"]
    rows = spec.make_dataset(256, 0)
    assert len(rows) == 64 and rows[9]["reset_kwargs"] == {"split": "train", "index": 9}
    assert spec.held_out_rows(16)[0] == "test"
    tool = spec.tool_class(server.url)
    try:
        task = source.TRAIN[9]
        shown = tool.reset(**rows[9])
        assert shown == task["problem"] and "solution" not in shown  # the task's prompt, never its spec
        assert tool.answer(answer=task["solution"]).startswith("Correct!") and tool.get_reward() == 1.0
        tool.reset(**rows[9])  # the model answered in plain text: submitted through `answer` at episode end
        assert submit_final_answer(tool, task["solution"])[3] is False and tool.get_reward() == 1.0
        tool.reset(**rows[9])
        assert tool.answer(answer="-1").startswith("Wrong!") and tool.get_reward() == 0.0
    finally:
        tool._client.close()
