"""#66 item 3: an env written on the `openreward` SDK's public API (tests/fixtures/envs/ors_arith/source, the layout
`orwd init` makes: 64 train and 16 test tasks, one `answer` tool), imported with the real `openenv import --type ors`
(the openenv 0.10.0 CLI), and what the import produced served in this process and learned by the generic path: the
stack trains on its train split, shows the task's prompt and never its spec (which holds the solution), and scores a
plain-text final answer through the `answer` tool; and a real CPU run (the tiny model, TRL's trainer) trains it: each
GRPO group plays one train task, whose problem (never its solution) is the user message, rewards are read from the env,
and the evaluation every EVAL_EVERY steps plays its test split. Host-only; what the import needs is recorded in the first
test."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from envs.core.tool import submit_final_answer
from envs.generic import GenericSpec
from tests.envs.inprocess import ThreadServer
from tests.helpers import without_gradio

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "ors_arith" / "source"
NAME = "ors_arith"


BATCH = 4  # PER_DEVICE_TRAIN_BATCH_SIZE = NUM_GENERATIONS: one group, one task, a step


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The package `openenv import --type ors` writes, imported and served (uvicorn in a thread)."""
    out = tmp_path_factory.mktemp("ors-import")
    done = subprocess.run([*without_gradio("openenv.cli"), "import", str(SOURCE), "--name", NAME,
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


def test_what_building_the_imports_image_depends_on(imported):
    """`make bench-ors` (bench/ors_image.py) builds the import's server/Dockerfile unchanged, FROM a locally built
    stand-in for openenv-base under the name its FROM line uses (bench/openenv_base/Dockerfile), with one line of its
    pyproject.toml changed. Every fact of the import and of the stand-in that build depends on."""
    from importlib.metadata import metadata

    from bench import ors_image

    package = imported[0]
    dockerfile = (package / "server" / "Dockerfile").read_text()
    stand_in = (ors_image.STAND_IN / "Dockerfile").read_text()
    # both stages start FROM the name the stand-in is tagged with
    assert f"ARG BASE_IMAGE={ors_image.BASE_IMAGE}\n" in dockerfile and dockerfile.count("FROM ${BASE_IMAGE}") == 2
    # a Debian base with Python 3.11 (apt-get installs git; the venv `uv sync` makes links to the base's python3, which
    # the runtime stage, FROM the same base, has at the same path)
    assert "apt-get install -y --no-install-recommends git" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim-bookworm$", stand_in, re.M)
    # uv on PATH, else it fetches https://astral.sh/uv/install.sh, which no registry-less machine reaches
    assert "if ! command -v uv" in dockerfile and "astral.sh/uv/install.sh" in dockerfile
    assert "uv==0.5.27" in stand_in and "command -v uv && command -v uvx" in stand_in  # upstream's base: uv 0.5.27
    # RUN --mount=type=cache: BuildKit, which the engine's Compose build has and this docker CLI (no buildx) has not
    assert "RUN --mount=type=cache,target=/root/.cache/uv" in dockerfile and "RUN --mount" not in stand_in
    # no uv.lock (the import writes one only where uv is on the host's PATH): `uv sync` resolves for every Python the
    # project allows, the template's >=3.10, while openreward needs 3.11: unsatisfiable, so the bench raises the floor
    assert not (package / "uv.lock").exists() and "uv sync --no-install-project --no-editable" in dockerfile
    assert ors_image.TEMPLATE_PYTHON in (package / "pyproject.toml").read_text().splitlines()
    assert metadata("openreward")["Requires-Python"] == ">=3.11" and ors_image.SDK_PYTHON.endswith('">=3.11"')
    # the server's port comes from the base: the import EXPOSEs nothing, the stack reads the image's EXPOSE
    # (tools/env_ports.py) and the server listens on 8000; its HEALTHCHECK calls curl, the stack's (compose.yaml) bash
    assert "EXPOSE" not in dockerfile and re.search(r"^EXPOSE 8000$", stand_in, re.M)
    assert "uvicorn server.app:app --host 0.0.0.0 --port 8000" in dockerfile and "curl -f http://localhost:8000" in \
        dockerfile and "command -v curl && command -v bash" in stand_in


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


@pytest.fixture(scope="module")
def ors_run(imported, tmp_path_factory, tiny_model_dir):
    """2 steps on the imported env, an evaluation at step 2. The import serves one session per container; here its
    generated Environment class is served by one create_app with BATCH sessions (marked concurrent: each session has
    its own instance) instead of BATCH containers."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    from ors_arith.server.ors_arith_environment import OrsArithEnvironment
    from trainer import train

    served = type("OrsArithServed", (OrsArithEnvironment,), {"SUPPORTS_CONCURRENT_SESSIONS": True})
    app = create_app(served, CallToolAction, CallToolObservation, env_name=NAME, max_concurrent_envs=BATCH)
    out = tmp_path_factory.mktemp("ors-run")
    printed = io.StringIO()
    with ThreadServer(NAME, app=app) as server, contextlib.redirect_stdout(printed):
        code = train.main(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(out),
                           "--env-name", NAME, "--env-urls", f"{NAME}={server.url}", "--run-name", "ors",
                           "--max-steps", "2", "--save-steps", "2", "--per-device-train-batch-size", str(BATCH),
                           "--num-generations", str(BATCH), "--max-completion-length", "48", "--trace-every", "1",
                           "--eval-every", "2", "--eval-episodes", "3"])
    print(printed.getvalue())
    assert code == 0
    return out / "ors", printed.getvalue()


def test_a_cpu_run_trains_the_imported_env_on_its_train_tasks(ors_run):
    import importlib.util

    from trainer.core.metrics import read_metrics

    run_dir, printed = ors_run
    found = importlib.util.spec_from_file_location("ors_arith_source_run", SOURCE / "server.py")
    source = importlib.util.module_from_spec(found)
    found.loader.exec_module(source)
    assert "serves its own tasks (OpenEnv's Task API): train (train) 64 tasks, test (test) 16 tasks; trains on " \
           "'train'" in printed and "submitted through its 'answer' tool" in printed
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * BATCH
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]
        [task] = {json.dumps(r["reset"]["reset_kwargs"], sort_keys=True) for r in group}  # one task a group
        task = json.loads(task)
        spec = source.TRAIN[task["index"]]
        user = [m for m in group[0]["prompt"] if m["role"] == "user"][-1]["content"]
        assert task["split"] == "train" and user == spec["problem"], user  # its prompt, never its spec
        for row in group:  # each episode scored by the env: the model's `answer` call, or its text submitted
            answers = [c for c in row["tool_calls"] if c["tool"].startswith("answer")]
            assert answers and row["env_reward"] in (0.0, 1.0), row
            assert row["env_reward"] == float(answers[-1]["arguments"].get("answer", "").strip() == spec["solution"])
    metrics = read_metrics(run_dir)
    assert all(r[f"env/{NAME}/episodes"] == BATCH and r.get(f"env/{NAME}/infra_failures", 0) == 0 for r in metrics)
    [evaluated] = [r for r in metrics if f"eval/{NAME}/episodes" in r]
    assert evaluated["step"] == 2 and evaluated[f"eval/{NAME}/episodes"] == 3
    assert "tasks of ors_arith 'test' split" in printed
