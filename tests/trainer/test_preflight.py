"""trainer.run.preflight: every failure is provoked for real and its message checked (numbers + fix)."""

from __future__ import annotations

import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from trainer.run import preflight
from contract.config import CpuMode, GpuMode, RunConfig
from trainer.run.preflight import PreflightError, PreflightReport, check_chat_template, sessions_needed

from .conftest import free_port


def cfg_for(**values) -> RunConfig:
    return RunConfig.load([], **values)


# ---------------------------------------------------------------- sessions TRL opens
def test_sessions_needed_single_env_is_the_generation_batch():
    cfg = cfg_for(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=4)
    assert sessions_needed(cfg, "echo") == 32  # steps_per_generation defaults to grad accumulation
    cfg = cfg_for(per_device_train_batch_size=8, steps_per_generation=2, num_generations=4)
    assert sessions_needed(cfg, "echo") == 16
    assert sessions_needed(cfg, "echo", num_processes=2) == 32


def test_sessions_needed_multi_env_is_capped_by_the_env_rows():
    cfg = cfg_for(env_name="echo,catch", per_device_train_batch_size=16, num_generations=4)
    assert sessions_needed(cfg, "echo") == 16  # worst case: a whole batch of echo rows
    assert sessions_needed(cfg, "echo", env_rows=2) == 8  # only 2 distinct echo prompts exist


def test_sessions_needed_matches_trl_pool(tmp_path, tiny_model_dir, echo_server, monkeypatch):
    """Run real GRPO steps; the env sessions TRL's pool holds (the server's count, read at the run's last step) ==
    what preflight computed, and the run closes every one of them at its end."""
    from trainer import train
    from trainer.run import training

    before = echo_server.health()["active_sessions"]
    argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
            "--env-urls", f"echo={echo_server.url}", "--max-steps", "1", "--per-device-train-batch-size", "4",
            "--steps-per-generation", "2", "--num-generations", "4", "--max-completion-length", "64"]
    held = []  # the server's count while TRL's pool is still open (the run prints its spread just before closing)
    printer = training.print_env_sessions
    monkeypatch.setattr(training, "print_env_sessions",
                        lambda *a: (held.append(echo_server.health()["active_sessions"] - before), printer(*a)))
    assert train.main(argv) == 0
    cfg = RunConfig.load(argv)
    # TRL keeps every pooled instance's session open until the run ends
    assert held == [sessions_needed(cfg, "echo")] == [8]
    assert echo_server.health()["active_sessions"] == before  # then the run closes them all


# ---------------------------------------------------------------- env servers
def test_unresolvable_env_host():
    cfg = cfg_for(env_urls="echo=http://env-echo.invalid:8000")
    errors = preflight.check_env_servers(cfg, PreflightReport(), wait_s=0)
    assert len(errors) == 1
    assert "env echo: cannot resolve 'env-echo.invalid'" in errors[0]
    assert "fix ENV_URLS" in errors[0]


def test_a_name_that_resolves_within_the_grace_period_passes(echo_server, monkeypatch):
    """Replicas just created can be healthy a moment before Docker's DNS answers for every name: preflight asks again
    within its grace period instead of stopping the run."""
    from trainer.rollouts.envs_binding import BindingError

    answers = [BindingError("cannot resolve 'env-echo' (Name or service not known)")] * 2 + [[echo_server.url]]
    asked = []

    def resolve_replicas(url):
        asked.append(url)
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(preflight, "resolve_replicas", resolve_replicas)
    report = PreflightReport()
    assert preflight.check_env_servers(cfg_for(), report, wait_s=30) == []
    assert len(asked) == 3 and report.replicas["echo"] == [echo_server.url]


def test_default_service_name_not_running():
    # outside compose `env-echo` does not resolve: the fix names the profile
    errors = preflight.check_env_servers(cfg_for(), PreflightReport(), wait_s=0)
    assert "COMPOSE_PROFILES must include echo" in errors[0]


def test_env_server_down():
    port = free_port()  # nothing listens there
    cfg = cfg_for(env_urls=f"echo=http://127.0.0.1:{port}")
    errors = preflight.check_env_servers(cfg, PreflightReport(), wait_s=0)
    assert f"env echo: not healthy: http://127.0.0.1:{port} (no answer (ConnectError))" in errors[0]
    assert "make logs" in errors[0]


def test_capacity_below_sessions_names_both_numbers(env_server_factory):
    server = env_server_factory("echo", capacity=4)
    cfg = cfg_for(env_urls=f"echo={server.url}", per_device_train_batch_size=8, num_generations=4)
    errors = preflight.check_env_servers(cfg, PreflightReport(), wait_s=0)
    assert len(errors) == 1
    msg = errors[0]
    assert "capacity 4 sessions over 1 replica(s) (reported by the servers) < 8 sessions this trainer opens" in msg
    assert "PER_DEVICE_TRAIN_BATCH_SIZE 8 x STEPS_PER_GENERATION 1" in msg
    assert "raise MAX_CONCURRENT_ENVS to >= 8" in msg and "ENV_ECHO_REPLICAS" in msg


def test_capacity_ok_against_real_server(echo_server):
    report = PreflightReport()
    cfg = cfg_for(env_urls=f"echo={echo_server.url}")
    assert preflight.check_env_servers(cfg, report, wait_s=0) == []
    assert report.sessions["echo"] == 8 and report.capacity["echo"] <= 64
    assert report.replicas["echo"] == [echo_server.url]


class _Handler(BaseHTTPRequestHandler):
    body = b'{"status": "healthy"}'  # like stock OpenEnv: no capacity in /health

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_server_without_capacity_report_is_probed_and_a_dead_ws_is_named():
    httpd = HTTPServer(("127.0.0.1", 0), _Handler)  # answers /health 200 without capacity; no /ws
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        errors = preflight.check_env_servers(cfg_for(env_urls=f"echo={url}"), PreflightReport(), wait_s=0)
        assert "env echo: capacity 0 sessions over 1 replica(s) (probed: the server does not report it; " \
               f"{url}: opening session 1:" in errors[0]
        assert "check `make logs` for env-echo: it accepted no session" in errors[0]
    finally:
        httpd.shutdown()


def test_episode_budget_warning(echo_server):
    report = PreflightReport()
    cfg = cfg_for(env_urls=f"echo={echo_server.url}", max_completion_length=32)
    assert preflight.check_env_servers(cfg, report, wait_s=0) == []
    assert any("MAX_COMPLETION_LENGTH=32 is below the ~96 tokens" in w for w in report.warnings)
    report = PreflightReport()
    preflight.check_env_servers(cfg_for(env_urls=f"echo={echo_server.url}", max_completion_length=256), report, 0)
    assert report.warnings == []


# ---------------------------------------------------------------- chat template
@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tiny_model_template_passes(tiny_tokenizer):
    assert check_chat_template(tiny_tokenizer, "tiny") == []


def test_no_chat_template(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = None
    [msg] = check_chat_template(tok, "m")
    assert "MODEL_NAME=m: its tokenizer has no chat template; use an instruct/chat model" in msg


def test_template_that_drops_tool_calls(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    [msg] = check_chat_template(tok, "m")
    assert "drops tool calls or tool results" in msg and "use a tool-calling model" in msg


def test_unrecognized_template(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    # renders tool calls and results fine, but TRL has no parser for it
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}"
        "{% endfor %}\n{% endfor %}"
    )
    [msg] = check_chat_template(tok, "m")
    assert 'TRL has no tool-call parser for this chat template ("Unrecognized chat template")' in msg


def test_missing_model(tmp_path):
    cfg = cfg_for(model_name=str(tmp_path / "nope"))
    tok, err = preflight.load_tokenizer(cfg.resolved(CpuMode()))
    assert tok is None
    assert f"MODEL_NAME={tmp_path / 'nope'}: cannot load its tokenizer" in err
    assert "docker compose --profile cpu run --rm model-init" in err


# ---------------------------------------------------------------- run_all and vLLM (gpu mode)
def test_run_all_collects_every_failure(tmp_path, monkeypatch):
    fake = types.ModuleType("trainer.gpu")

    def preflight_vllm(cfg):
        raise RuntimeError(f"{cfg.vllm_server_url}/server_info answered 404: dev mode is off; set VLLM_SERVER_DEV_MODE=1")

    fake.preflight_vllm = preflight_vllm
    monkeypatch.setitem(sys.modules, "trainer.gpu", fake)
    import trainer

    monkeypatch.setattr(trainer, "gpu", fake, raising=False)
    cfg = cfg_for(env_urls=f"echo=http://127.0.0.1:{free_port()}", model_name=str(tmp_path / "nope"),
                  vllm_server_url="http://127.0.0.1:1")
    with pytest.raises(PreflightError) as exc:
        preflight.run_all(cfg.resolved(GpuMode()), wait_s=0)
    lines = str(exc.value).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("- env echo: not healthy")
    assert lines[1].startswith(f"- MODEL_NAME={tmp_path / 'nope'}: cannot load its tokenizer")
    assert lines[2] == "- vLLM: http://127.0.0.1:1/server_info answered 404: dev mode is off; set VLLM_SERVER_DEV_MODE=1"


def test_cli_exit_code_on_failure(tmp_path):
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "TRAIN_MODE": "cpu", "MODEL_NAME": str(tmp_path / "nope"),
           "ENV_URLS": "echo=http://env-echo.invalid:8000"}
    res = subprocess.run([sys.executable, "-m", "trainer.run.preflight"], env=env, capture_output=True, text=True,
                         cwd=preflight.__file__.rsplit("/trainer/", 1)[0])
    assert res.returncode == 3
    assert "[preflight] FAILED:" in res.stderr and "cannot resolve 'env-echo.invalid'" in res.stderr
