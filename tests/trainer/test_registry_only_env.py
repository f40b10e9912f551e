"""A built-in env costs its folder (found by the ENV its __init__.py declares: envs/registry.py), nothing else. An env known only to the
registry (here echo's spec under a new name, pointing at echo's folder; tests/envs/test_env_folders.py shows a new
folder is found) is accepted by the env server's own settings, served by envs.serve, and trained on by trainer.train,
with no other file changed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import requests

from envs import registry
from trainer import train

from .conftest import ROOT, free_port

ADD_PARROT = ("import dataclasses, envs.registry as r; "
              "r._SPECS['parrot'] = dataclasses.replace(r._SPECS['echo'], name='parrot')")


def test_an_env_added_only_to_the_registry_is_served_and_trained_on(tiny_model_dir, tmp_path, monkeypatch):
    port = free_port()
    env = dict(os.environ, ENV_NAME="parrot", PORT=str(port), HOST="127.0.0.1", MAX_CONCURRENT_ENVS="16",
               LOG_LEVEL="warning")
    server = subprocess.Popen([sys.executable, "-c", f"{ADD_PARROT}; from envs.serve import main; main()"], cwd=ROOT,
                              env=env, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:  # until it serves (or died: e.g. its settings refused the name)
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        monkeypatch.setitem(registry._SPECS, "parrot", dataclasses.replace(registry._SPECS["echo"], name="parrot"))
        assert "parrot" in registry.names()
        argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
                "--env-name", "parrot", "--env-urls", f"parrot={url}", "--max-steps", "1", "--run-name", "parrot",
                "--per-device-train-batch-size", "4", "--num-generations", "4", "--max-completion-length", "64"]
        assert train.main(argv) == 0
        assert (tmp_path / "parrot" / "metrics.jsonl").read_text().count('"kind": "step"') == 1
    finally:
        server.kill()
        server.wait()
