"""A failed push must not leave the next run a wedged vLLM (#29 item 2), without Docker: the weight-push marker
(trainer.gpu.push_state), trainer.launch's exit code for "restart vLLM first", the one-token probe and the
generation watchdog against stub HTTP servers, and `make train`'s restart-once rule (tools/commands/train.py).
The docker rehearsal on the twin is tests/gpu_path/test_vllm_recovery_rehearsal.py.

Test doubles, named so: a Python loop stands in for an NCCL broadcast; stub HTTP servers stand in for a vLLM that
answers, errs or hangs; plain functions stand in for `docker compose run` / `up` in the restart rule."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest

from tests.gpu_path.test_gpu_side import fake_trainer
from tests.helpers import JsonStubHandler, stub_http_server
from contract.defaults import EXIT_VLLM_RESTART, EXIT_VLLM_WENT_AWAY
from trainer.gpu import push_state, trl_hooks, watchdog


@pytest.fixture
def marker_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    return tmp_path


def test_the_marker_follows_the_group_and_each_push_and_a_clean_finish_removes_it(marker_dir):
    assert push_state.read(str(marker_dir)) is None
    push_state.group_formed("NCCL, trainer at 172.20.0.7:51216")
    assert push_state.read(str(marker_dir))["state"] == "group"
    push_state.push_started(3)
    left = push_state.read(str(marker_dir))
    assert left["state"] == "push" and left["run"] == "run-a" and "before step 4" in left["detail"]
    push_state.push_done(3)
    assert push_state.read(str(marker_dir))["state"] == "group"
    assert [p.name for p in marker_dir.iterdir()] == [push_state.MARKER_NAME]  # atomic: no .partial left
    push_state.clean_finish()
    assert push_state.read(str(marker_dir)) is None


def test_a_process_that_does_not_push_writes_no_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(push_state, "_STATE", {})  # ranks > 0: preflight (rank 0 only) never configured them
    push_state.group_formed("x")
    push_state.push_started(0)
    assert list(tmp_path.iterdir()) == []


def test_a_sync_marks_its_push_and_one_past_its_deadline_stays_marked_test_double_for_nccl_broadcast(marker_dir):
    trainer = fake_trainer(seconds=0.0)
    trl_hooks.instrument_weight_sync(trainer, lambda s: None, timeout_s=10)
    trainer.vllm_generation.sync_weights()
    assert push_state.read(str(marker_dir))["state"] == "group"
    stuck = fake_trainer(seconds=0.02, loops=500)
    trl_hooks.instrument_weight_sync(stuck, lambda s: None, timeout_s=0.3)
    with pytest.raises(watchdog.WeightSyncTimeout):
        stuck.vllm_generation.sync_weights()
    assert push_state.read(str(marker_dir))["state"] == "push"  # what the next launch finds


# ------------------------------------------------------------------ vLLM stand-ins over HTTP
@contextmanager
def stub_vllm(completion: tuple[int, dict] | None = (200, {"choices": [{"text": "x"}]}), health: int = 200,
              started: list[float] | None = None):
    """GET /health, /v1/models and POST /v1/completions; completion None: the request hangs until the stub closes.
    `started`: GET /metrics says process_start_time_seconds started[0] (as vLLM's does), read at each request."""
    release = threading.Event()

    class Handler(JsonStubHandler, BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/health":
                self.reply(health, {})
            elif path == "/v1/models":
                self.reply(200, {"data": [{"id": "org/tiny", "max_model_len": 512}]})
            elif path == "/metrics" and started is not None:
                text = f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {started[0]}\n".encode()
                self.send_response(200)
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if completion is None:
                release.wait()  # a hung engine: no byte until the test ends
                return
            self.reply(*completion)

    with stub_http_server(Handler) as url:
        try:
            yield url, release
        finally:
            release.set()  # before the server closes: a hung request's thread ends
    # closed (stub_http_server): the port refuses from here on, as a stopped vLLM's does


def test_a_marker_left_behind_asks_for_a_restart_once_without_asking_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    push_state.push_started(7)
    monkeypatch.setattr(push_state, "_STATE", {})  # the next run's launcher: it only reads
    reason = push_state.restart_reason(str(tmp_path), "http://127.0.0.1:9", timeout_s=1)  # nothing listens there
    assert "the last run (run-a)" in reason and "weight push in flight (before step 8)" in reason
    assert push_state.read(str(tmp_path)) is None  # consumed: the host restarts vLLM on this exit code
    line = push_state.restart_line(reason)
    assert f"exit {EXIT_VLLM_RESTART}" in line and "docker compose up -d --no-deps --force-recreate --wait vllm" in line


def test_the_one_token_probe_passes_a_generating_server_and_names_an_erring_or_hung_one_stub_servers(tmp_path):
    with stub_vllm() as (url, _):
        assert push_state.restart_reason(str(tmp_path), url, timeout_s=5) is None
    dead = (500, {"error": {"message": "EngineCore encountered an issue."}})
    with stub_vllm(completion=dead) as (url, _):
        assert "answered HTTP 500: " in push_state.restart_reason(str(tmp_path), url, timeout_s=5)
    with stub_vllm(completion=None) as (url, _):
        assert "no one-token completion within 1s" in push_state.restart_reason(str(tmp_path), url, timeout_s=1)


def test_a_server_that_is_not_up_is_left_to_preflight_not_restarted_stub_server(tmp_path):
    with stub_vllm(health=503) as (url, _):
        assert push_state.restart_reason(str(tmp_path), url, timeout_s=0.5) is None


def test_launch_exits_with_the_restart_code_before_starting_any_process(tmp_path, monkeypatch, capsys):
    from trainer import launch

    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    push_state.group_formed("reload from /weights")
    monkeypatch.setattr(push_state, "_STATE", {})
    for key, value in {"TRAIN_MODE": "gpu", "OUTPUT_DIR": str(tmp_path), "ENV_NAME": "echo",
                       "VLLM_SERVER_URL": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "process_count", lambda *a: pytest.fail("a trainer process was about to start"))
    assert launch.main([]) == EXIT_VLLM_RESTART
    assert "The vllm service needs a restart" in capsys.readouterr().err


def test_a_generation_vllm_never_answers_ends_with_a_diagnosis_stub_server(trl_client_cls, monkeypatch, capsys):
    expired = []
    with stub_vllm(completion=None) as (url, release):
        def expire(code):  # instead of os._exit(75): record it and let the hung request return
            expired.append(code)
            release.set()

        monkeypatch.setattr(watchdog, "_hard_exit", expire)
        monkeypatch.setattr(trl_client_cls, "generate", trl_client_cls.generate)  # undone after the test
        trl_hooks.guard_generation(0.3, grace_s=0.2)
        client = trl_client_cls(base_url=url, connection_timeout=5)
        with pytest.raises(watchdog.WeightSyncTimeout, match="did not answer a generation request in 0s"):
            client.generate([[11, 12, 13]], max_tokens=1)
    assert expired == [watchdog.EXIT_WEIGHT_SYNC_TIMEOUT]
    err = capsys.readouterr().err
    assert "docker compose logs vllm" in err and "GENERATION_TIMEOUT_S" in err


def test_make_train_restarts_vllm_once_on_the_restart_code_stand_in_commands():
    from tools.commands.train import recovering

    def scripted(codes):
        calls = []

        def run_trainer(extra=()):
            calls.append(" ".join(["trainer", *extra]))
            return codes.pop(0)

        def restart_vllm():
            calls.append("restart")
            return 0

        return calls, run_trainer, restart_vllm

    calls, trainer, restart = scripted([EXIT_VLLM_RESTART, 0])
    assert recovering(trainer, restart) == 0 and calls == ["trainer", "restart", "trainer"]
    calls, trainer, restart = scripted([EXIT_VLLM_RESTART, EXIT_VLLM_RESTART])
    assert recovering(trainer, restart) == EXIT_VLLM_RESTART and calls == ["trainer", "restart", "trainer"]  # no loop
    calls, trainer, restart = scripted([3])
    assert recovering(trainer, restart) == 3 and calls == ["trainer"]
    calls, trainer, _ = scripted([EXIT_VLLM_RESTART])
    assert recovering(trainer, lambda: 1) == 1 and calls == ["trainer"]  # a failed restart: stop, say so
    # vLLM went away mid-run (#33 item 5): restarted, and the run resumes from its last checkpoint, once
    calls, trainer, restart = scripted([EXIT_VLLM_WENT_AWAY, 0])
    assert recovering(trainer, restart) == 0 and calls == ["trainer", "restart", "trainer --resume auto"]
    calls, trainer, restart = scripted([EXIT_VLLM_WENT_AWAY, EXIT_VLLM_WENT_AWAY])
    assert recovering(trainer, restart) == EXIT_VLLM_WENT_AWAY and len(calls) == 3


def test_make_train_restarts_the_stacks_judge_once_when_it_stayed_down_stand_in_commands():
    """Issue 64 item 4: a judge that stays down stops the run (EXIT_JUDGE_DOWN); `make train` restarts the stack's
    judge service, health-gated, and resumes, once; a judge elsewhere (JUDGE_URL: no restart given) leaves the exit."""
    from contract.defaults import EXIT_JUDGE_DOWN
    from tools.commands.train import recovering

    def scripted(codes):
        calls = []

        def run_trainer(extra=()):
            calls.append(" ".join(["trainer", *extra]))
            return codes.pop(0)

        return calls, run_trainer

    calls, trainer = scripted([EXIT_JUDGE_DOWN, 0])
    assert recovering(trainer, None, lambda: calls.append("restart judge") or 0) == 0
    assert calls == ["trainer", "restart judge", "trainer --resume auto"]
    calls, trainer = scripted([EXIT_JUDGE_DOWN, EXIT_JUDGE_DOWN])
    assert recovering(trainer, None, lambda: 0) == EXIT_JUDGE_DOWN and len(calls) == 2  # once, no loop
    calls, trainer = scripted([EXIT_JUDGE_DOWN])
    assert recovering(trainer, lambda: 0, None) == EXIT_JUDGE_DOWN and calls == ["trainer"]  # JUDGE_URL: not ours
    calls, trainer = scripted([EXIT_VLLM_WENT_AWAY])
    assert recovering(trainer, None, lambda: 0) == EXIT_VLLM_WENT_AWAY and calls == ["trainer"]  # no vllm service


def test_a_vllm_that_went_away_mid_run_is_named_and_any_other_failure_is_not_stub_servers(trl_client_cls):
    """#33 item 5: TRL's own client generating against a server that then stops (its port closed: what a vLLM
    restart or crash leaves) fails with a connection error the trainer reads as 'vLLM went away' (exit
    EXIT_VLLM_WENT_AWAY, so `make train` restarts it and resumes); a failure while vLLM answers /health is not."""
    from trainer.gpu.server import gone_line, went_away

    with stub_vllm() as (url, _):
        client = trl_client_cls(base_url=url, connection_timeout=5)
        assert went_away(RuntimeError("a bug in the trainer"), url) is None  # vLLM healthy: not its failure
    with stub_vllm(health=503) as (sick, _):
        assert "/health answers HTTP 503" in went_away(RuntimeError("x"), sick)
    # the stub is gone now: the next generation is refused. TRL's session retries a refused connection 5 times with
    # backoff (about 30 s: a shorter restart is ridden out there); turned off here, where it only adds time
    import requests

    client.session.mount("http://", requests.adapters.HTTPAdapter(max_retries=0))
    with pytest.raises(Exception) as failed:
        client.generate([[11, 12, 13]], max_tokens=1)
    why = went_away(failed.value, url)
    assert why and why.startswith("a request to it failed (ConnectionError"), why
    try:  # the chain: a failure raised while handling the refused request is read through its cause
        raise RuntimeError("rollout loop: generation failed") from failed.value
    except RuntimeError as wrapped:
        assert went_away(wrapped, url).startswith("a request to it failed")
    assert "does not answer" in went_away(ValueError("no chain"), url)  # nothing listens: /health is refused too
    line = gone_line(url, why, EXIT_VLLM_WENT_AWAY)
    assert "\n" not in line and "make train" in line and f"exit {EXIT_VLLM_WENT_AWAY}" in line


def test_a_vllm_restarted_between_a_push_and_a_generation_stops_the_step_stub_servers(marker_dir, monkeypatch):
    """#33 item 5: a vLLM that restarts inside TRL's client retries fails no request, and the new process serves the
    weights it loaded at start. After a step's generations the trainer compares the process that answered (its
    /metrics' process_start_time_seconds) with the one the last push went into: another one stops the run before
    its optimizer step, read as 'vLLM went away' (exit 77: `make train` restarts vLLM and resumes). A push into the
    new process makes it the run's again; a vLLM whose /metrics does not say is not checked."""
    from types import SimpleNamespace

    from trainer.gpu.server import VLLMRestarted, gone_line, started_at, went_away

    monkeypatch.setattr(trl_hooks, "_GUARD", {})
    started = [1796294967.7]
    with stub_vllm(started=started) as (url, _):
        trainer = fake_trainer()
        trainer.vllm_generation.vllm_client = SimpleNamespace(base_url=url)  # rank 0's: the one that pushes
        trainer.vllm_generation.accelerator = SimpleNamespace(is_main_process=True)
        trl_hooks.instrument_weight_sync(trainer, lambda s: None, timeout_s=10)
        trl_hooks.check_served_weights()  # no push yet: nothing to compare
        trainer.vllm_generation.sync_weights()
        trl_hooks.check_served_weights()  # the process the push went into answered
        started[0] += 42.0  # restarted: a new process, no failed request
        with pytest.raises(VLLMRestarted, match="started 42 s after the one the push went into") as restarted:
            trl_hooks.check_served_weights()
        why = went_away(restarted.value, url)
        assert why == str(restarted.value)
        line = gone_line(url, why, EXIT_VLLM_WENT_AWAY)
        assert "\n" not in line and "went away mid-run: it restarted after the last weight push" in line
        trainer.vllm_generation.sync_weights()  # pushed into the new process: the run's weights again
        trl_hooks.check_served_weights()
    with stub_vllm() as (quiet, _):
        assert started_at(quiet) is None  # /metrics says nothing: no check, no false stop
        monkeypatch.setattr(trl_hooks, "_GUARD", {"served_url": quiet, "pushed_into": None})
        trl_hooks.check_served_weights()



def test_an_async_trainer_waiting_for_samples_stops_for_a_vllm_gone_or_restarted_stub_servers(monkeypatch):
    """#33: with ROLLOUTS=async a vLLM that dies failed nothing the trainer saw: TRL's rollout worker retries each
    refused generation (30 tries, backoff to 16 s) while the trainer waits for samples, and the run hung silently.
    The health check TRL calls every 5 s on an empty queue (async_run.stop_on_env_or_vllm_down) now asks the vLLM the
    last push went into: refused is VLLMGone, another process is VLLMRestarted; both read as 'went away' (exit 77:
    `make train` restarts vLLM and resumes). A vLLM that answers, slowly or not, is left to TRL's worker."""
    from types import SimpleNamespace

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.gpu.server import VLLMGone, VLLMRestarted, gone_line, went_away
    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down

    monkeypatch.setattr(trl_hooks, "_GUARD", {})
    worker = object.__new__(AsyncRolloutWorker)  # TRL's class (its __init__ wants vLLM installed)
    worker._failed_event, worker._exception_info_queue = threading.Event(), None
    worker._heartbeat_value = SimpleNamespace(value=__import__("time").time())
    worker._process = SimpleNamespace(pid=4242, exitcode=None, is_alive=lambda: True)
    stop_on_env_or_vllm_down(worker)
    started = [1796294967.7]
    with stub_vllm(started=started) as (url, _):
        worker.check_health(300.0)  # no push yet: nothing to ask
        trl_hooks.record_push(url)
        worker.check_health(300.0)  # the process the push went into answers
        started[0] += 42.0
        with pytest.raises(VLLMRestarted, match="started 42 s after"):
            worker.check_health(300.0)
        trl_hooks.record_push(url)  # pushed into the new process: the run's weights again
        worker.check_health(300.0)
    with pytest.raises(VLLMGone, match="/health is refused") as gone:
        worker.check_health(300.0)  # the stub's port is closed now: a killed vLLM
    why = went_away(gone.value, url)
    assert why == str(gone.value)
    line = gone_line(url, why, EXIT_VLLM_WENT_AWAY)
    assert "\n" not in line and f"exit {EXIT_VLLM_WENT_AWAY}" in line


def test_an_async_push_into_a_restarted_vllm_stops_before_it_and_a_batch_from_one_before_it_trains_stub_servers(
        monkeypatch):
    """The async trainer's samples come from whichever process answered since the last push: a vLLM that restarted
    (and came back inside TRL's worker retries) served base weights under the run's policy version. The push after it
    and the next micro-batch both check first (async_run.AfterRun), so those samples never train: exit 77."""
    from types import SimpleNamespace

    from trainer.gpu.server import VLLMRestarted
    from trainer.async_grpo.async_run import AfterRun

    monkeypatch.setattr(trl_hooks, "_GUARD", {})
    started, pushes, steps = [1796294967.7], [], []

    class TRLStandIn:  # the two AsyncGRPOTrainer methods AfterRun wraps
        def _sync_weight(self):
            pushes.append(started[0])

        def training_step(self, model, inputs, num_items_in_batch=None):
            steps.append(inputs)
            return 0.0

    class Trainer(AfterRun, TRLStandIn):
        pass

    with stub_vllm(started=started) as (url, _):
        trainer = Trainer()
        trainer.accelerator = SimpleNamespace(is_main_process=True)
        trainer.args = SimpleNamespace(vllm_server_base_url=url)
        trainer.state = SimpleNamespace(global_step=0)
        trainer._sync_weight()  # TRL's push before the first step
        trainer.training_step(None, "batch 1")
        trainer._sync_weight()
        started[0] += 30.0  # restarted, and back
        with pytest.raises(VLLMRestarted):
            trainer.training_step(None, "batch 2")
        with pytest.raises(VLLMRestarted):
            trainer._sync_weight()
    assert steps == ["batch 1"] and len(pushes) == 2


def test_a_vllm_without_its_process_start_time_is_refused_in_one_line_at_preflight():
    """vLLM data parallel runs its metrics multi-process: /metrics has no process_start_time_seconds, the one signal
    the trainer tells a restarted vLLM by. Server mode's preflight (server_checks.preflight_vllm) refuses it."""
    from trainer.gpu.server import restart_blind

    with stub_vllm(started=[1_700_000_000.0]) as (url, _):
        assert restart_blind(url) is None
    with stub_vllm(started=None) as (url, _):
        line = restart_blind(url)
    assert line is not None and "\n" not in line
    assert "process_start_time_seconds" in line and "VLLM_PARALLEL=tensor" in line
