"""trainer.gpu without vLLM or a GPU: mode -> GRPOConfig kwargs, NCCL defaults, the
trainer's address, the watchdog, weight-sync timing, and the server checks against stub servers.

The watchdog / weight-sync tests are test doubles for GPU-only steps: a Python loop or a blocked
wait stands in for an NCCL rendezvous or broadcast that never completes."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest

from trainer.gpu import grpo_kwargs, nccl, server, trl_hooks, watchdog
from tests.helpers import ROOT, JsonStubHandler, stub_http_server
from trainer.core import grpo_args


def cfg(**kw):
    """The trainer's typed settings (what trainer.gpu takes), from explicit values only."""
    from contract.config import RunConfig

    base = dict(train_mode="gpu", vllm_server_url="http://vllm:8000/", vllm_max_model_len=None)
    base.update(kw)
    return RunConfig(**base)


# ------------------------------------------------------------------ imports stay light
def test_importing_the_gpu_side_pulls_in_no_vllm_torch_or_trl():
    code = ("import sys, trainer.gpu, trainer.sync_check; "
            "print([m for m in ('vllm', 'torch', 'trl', 'requests') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ GRPOConfig kwargs
def test_gpu_mode_is_trl_server_mode_with_the_configured_url_port_and_timeout():
    kw = grpo_kwargs.grpo_vllm_kwargs(cfg(vllm_group_port=51300, vllm_server_timeout_s=600))
    assert kw == {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://vllm:8000",
                  "vllm_server_timeout": 600.0, "vllm_group_port": 51300,
                  "generation_kwargs": {"presence_penalty": 0.0, "frequency_penalty": 0.0}}


# vllm 0.31 CompletionRequest._DEFAULT_SAMPLING_PARAMS: the fields the server fills from the model's generation_config
# when a request leaves them out (read in the vllm-cpu image; test_weight_push_lands_on_twin.py shows it happen).
VLLM_FILLED_FROM_GENERATION_CONFIG = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                                      "top_p", "top_k", "min_p")


@pytest.mark.parametrize("mode", ["gpu", "colocate"])
def test_both_modes_send_every_sampling_field_vllm_would_fill_from_the_generation_config(mode, tmp_path):
    """Server mode's request (trl VLLMGeneration.generate -> VLLMClient.generate) names each field vLLM would take
    from generation_config.json, and colocate's SamplingParams get the same values: both sample one policy."""
    from contract.config import RunConfig

    args = grpo_args.grpo_config(RunConfig(train_mode=mode), output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                     **grpo_kwargs.grpo_vllm_kwargs(RunConfig(train_mode=mode)))
    # the fields trl 1.16 sets itself in both modes (vllm_generation.py), then generation_kwargs on top
    sent = {"repetition_penalty": args.repetition_penalty, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p or 0.0, **args.generation_kwargs}
    assert set(VLLM_FILLED_FROM_GENERATION_CONFIG) <= set(sent)
    assert sent["presence_penalty"] == sent["frequency_penalty"] == 0.0 and sent["repetition_penalty"] == 1.0


def test_one_gpu_profile_is_trl_colocate_mode_with_a_shared_memory_budget():
    kw = grpo_kwargs.grpo_vllm_kwargs(cfg(train_mode="colocate", vllm_max_model_len=2048))
    assert kw["use_vllm"] is True and kw["vllm_mode"] == "colocate"
    assert kw["vllm_gpu_memory_utilization"] == 0.3  # the trainer shares the card
    assert kw["vllm_max_model_length"] == 2048
    assert "vllm_server_base_url" not in kw
    assert grpo_kwargs.grpo_vllm_kwargs(cfg(train_mode="colocate", vllm_gpu_memory_utilization=0.45))[
        "vllm_gpu_memory_utilization"] == 0.45
    assert "vLLM runs inside the trainer" in grpo_kwargs.describe_mode(cfg(train_mode="colocate"))


def test_cpu_mode_does_not_use_vllm_and_unknown_modes_are_refused():
    assert grpo_kwargs.grpo_vllm_kwargs(cfg(train_mode="cpu")) == {"use_vllm": False}
    with pytest.raises(ValueError, match="train_mode"):  # refused by the typed settings before any kwargs
        cfg(train_mode="tpu")


@pytest.mark.parametrize("mode", ["gpu", "colocate"])
def test_kwargs_are_accepted_by_trl_grpoconfig_and_by_the_real_runconfig(mode, tmp_path):
    from trl import GRPOConfig

    from contract.config import RunConfig

    run_cfg = RunConfig(train_mode=mode)
    kw = grpo_kwargs.grpo_vllm_kwargs(run_cfg)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kw)
    assert args.use_vllm is True
    assert args.vllm_mode == ("server" if mode == "gpu" else "colocate")
    if mode == "gpu":
        assert args.vllm_server_base_url == run_cfg.vllm_server_url
        assert args.vllm_group_port == run_cfg.vllm_group_port


# ------------------------------------------------------------------ NCCL + address
def test_nccl_defaults_suit_a_bridge_network_and_user_values_win():
    assert nccl.nccl_env({}) == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                                      "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}
    env = {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "INFO"}
    changes = nccl.apply_nccl_env(env)
    assert env["NCCL_SOCKET_IFNAME"] == "ens5" and env["NCCL_DEBUG"] == "INFO"
    assert "NCCL_SOCKET_IFNAME" not in changes and env["NCCL_P2P_DISABLE"] == "1"


def test_fast_path_opt_in_enables_p2p_and_shm():
    env = {"NCCL_FAST_PATH": "1", "NCCL_P2P_DISABLE": "1"}
    nccl.apply_nccl_env(env)
    assert env["NCCL_P2P_DISABLE"] == "0" and env["NCCL_SHM_DISABLE"] == "0"
    assert env["NCCL_IB_DISABLE"] == "1"


def test_trainer_address_is_never_loopback_and_the_error_names_the_fix():
    assert not nccl._is_usable_ip("127.0.0.1") and not nccl._is_usable_ip("0.0.0.0")
    assert nccl._is_usable_ip("172.18.0.5")
    with pytest.raises(server.VLLMPreflightError, match="VLLM_HOST_IP"):
        nccl.resolve_host_ip(peer_host=None, hostname="localhost")


def local_ipv4_interfaces() -> dict[str, str]:
    """name -> IPv4 address of this machine's non-loopback interfaces (SIOCGIFADDR, as `ip -4 addr` reads them)."""
    import fcntl
    import struct

    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])
            except OSError:
                continue
        if not ip.startswith("127."):
            found[name] = ip
    return found


def test_rendezvous_address_and_interface_are_derived_when_compose_passes_them_empty():
    interfaces = local_ipv4_interfaces()
    assert interfaces, "no IPv4 interface besides loopback on this machine"
    name, ip = sorted(interfaces.items(), key=lambda kv: kv[0] == "eth0")[0]  # not eth0 when there is another
    env = {"VLLM_HOST_IP": ""}  # what Compose passes for a variable .env leaves out
    assert nccl.prepare_rendezvous(f"http://{ip}:8000", env) == ip  # the route towards vLLM's address
    assert env["VLLM_HOST_IP"] == ip and env["NCCL_SOCKET_IFNAME"] == name and env["NCCL_IB_DISABLE"] == "1"
    mine = {"VLLM_HOST_IP": "10.9.8.7", "NCCL_SOCKET_IFNAME": "ens5"}  # the user's own values win
    assert nccl.prepare_rendezvous("http://vllm:8000", mine) == "10.9.8.7" and mine["NCCL_SOCKET_IFNAME"] == "ens5"


def test_trainer_address_is_the_route_towards_the_vllm_host(monkeypatch):
    calls = {}

    class FakeSock:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def connect(self, addr):
            calls["peer"] = addr

        def getsockname(self):
            return ("172.20.0.7", 40000)

    monkeypatch.setattr(nccl.socket, "getaddrinfo",
                        lambda host, *a: [(None, None, None, None, ("172.20.0.2", 0))])
    monkeypatch.setattr(nccl.socket, "socket", FakeSock)
    assert nccl.resolve_host_ip("vllm") == "172.20.0.7"
    assert calls["peer"][0] == "172.20.0.2"


def test_group_port_in_use_is_reported_with_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        problem = nccl.check_group_port("127.0.0.1", port)
    assert problem and "VLLM_GROUP_PORT" in problem
    assert nccl.check_group_port("127.0.0.1", port) is None


# ------------------------------------------------------------------ watchdog (GPU-only stand-ins)
def test_watchdog_stands_in_for_a_stuck_rendezvous_and_raises_the_diagnosis():
    diag = lambda s: watchdog.rendezvous_diagnosis("172.20.0.7", 51216, s)  # noqa: E731
    waited = 0
    with pytest.raises(watchdog.WeightSyncTimeout) as err:
        with watchdog.watchdog(0.3, diag, grace_s=5, on_expire=lambda code: None):
            for waited in range(3000):  # a Python-level wait (>= 60 s): the exception ends it early
                time.sleep(0.02)
    assert waited < 2999
    text = str(err.value)
    assert "172.20.0.7:51216" in text and "make nccl-check" in text and "NCCL_SOCKET_IFNAME" in text


def test_watchdog_stands_in_for_a_hang_inside_nccl_and_ends_the_process():
    exits = []
    blocker = threading.Event()
    with pytest.raises(watchdog.WeightSyncTimeout):
        with watchdog.watchdog(0.2, lambda s: "stuck", grace_s=0.2,
                                on_expire=lambda code: (exits.append(code), blocker.set())):
            blocker.wait(10)  # a blocking C call; only the hard exit would end it for real
    assert exits == [watchdog.EXIT_WEIGHT_SYNC_TIMEOUT]


def test_watchdog_is_silent_when_the_block_finishes_in_time():
    before = set(threading.enumerate())
    with watchdog.watchdog(600, lambda s: pytest.fail("diagnosed"), on_expire=lambda c: pytest.fail("fired")):
        time.sleep(0.05)
    # the watchdog thread ends as soon as the block does, without firing: no exception can come later
    for thread in set(threading.enumerate()) - before:
        thread.join(60)
        assert not thread.is_alive(), f"{thread.name} still running after the block ended"


# ------------------------------------------------------------------ weight-sync timing
def fake_trainer(mode="server", seconds=0.05, loops=1):
    def sync_weights():
        for _ in range(loops):
            time.sleep(seconds)
        return "synced"

    gen = SimpleNamespace(mode=mode, sync_weights=sync_weights)
    from collections import defaultdict

    return SimpleNamespace(vllm_generation=gen, args=SimpleNamespace(vllm_group_port=51216),
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


def test_each_weight_sync_is_timed_and_logged_test_double_for_nccl_broadcast():
    trainer, logged = fake_trainer(), []
    assert trl_hooks.instrument_weight_sync(trainer, logged.append, timeout_s=10) is True
    assert trl_hooks.instrument_weight_sync(trainer, logged.append, timeout_s=10) is True  # idempotent
    assert trainer.vllm_generation.sync_weights() == "synced"
    trainer.vllm_generation.sync_weights()
    assert len(logged) == 2 and all(s >= 0.04 for s in logged)  # each covers the 0.05 s sync
    assert trainer._metrics["train"]["weight_sync/seconds"] == logged


def test_a_weight_sync_past_the_timeout_fails_with_a_diagnosis_test_double_for_nccl_broadcast():
    trainer, logged = fake_trainer(seconds=0.02, loops=500), []
    trl_hooks.instrument_weight_sync(trainer, logged.append, timeout_s=0.3)
    with pytest.raises(watchdog.WeightSyncTimeout, match="weight sync did not finish in 0s|weight sync"):
        trainer.vllm_generation.sync_weights()
    assert logged == []


def test_the_smokes_first_weight_sync_stage_is_the_first_push_after_a_step(monkeypatch, capsys):
    from contract import stages

    monkeypatch.setattr(stages, "_seen", set())
    trainer, logged = fake_trainer(seconds=0.0), []
    trainer.state = SimpleNamespace(global_step=0)
    trl_hooks.instrument_weight_sync(trainer, logged.append, timeout_s=10)
    trainer.vllm_generation.sync_weights()  # TRL's push before step 1: the weights it loaded with
    assert "first_weight_sync" not in stages.parse(capsys.readouterr().out)
    trainer.state.global_step = 1
    trainer.vllm_generation.sync_weights()
    assert "trained weights" in stages.parse(capsys.readouterr().out)["first_weight_sync"]["detail"]
    assert len(logged) == 2  # both are timed and logged all the same


def test_trainers_without_vllm_are_left_alone():
    assert trl_hooks.instrument_weight_sync(SimpleNamespace(), lambda s: None) is False


# ------------------------------------------------------------------ server checks on stub servers
@contextmanager
def stub_server(routes: dict[str, tuple[int, dict]]):
    class Handler(JsonStubHandler, BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.reply(*routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"})))

    with stub_http_server(Handler) as url:
        yield url


def info(wtc=({"backend": "nccl"}), logprobs_mode="processed_logprobs", cuda="True"):
    return {"vllm_config": {"weight_transfer_config": wtc, "model_config": {"logprobs_mode": logprobs_mode}},
            "system_env": {"vllm_version": "0.31.0", "torch_version": "2.13.0+cu130", "is_cuda_available": cuda}}


HEALTHY = {"/health": (200, {}), "/get_world_size": (200, {"world_size": 1}),
           "/v1/models": (200, {"data": [{"id": "Qwen/Qwen3-0.6B", "max_model_len": 4096}]})}


def test_dev_mode_off_is_diagnosed_from_the_404():
    with stub_server(HEALTHY) as url:
        with pytest.raises(server.VLLMPreflightError, match="VLLM_SERVER_DEV_MODE=1"):
            server.check_vllm_server(url, timeout_s=5)


def test_missing_nccl_weight_transfer_is_diagnosed():
    with stub_server({**HEALTHY, "/server_info": (200, info(wtc=None))}) as url:
        with pytest.raises(server.VLLMPreflightError, match="--weight-transfer-config"):
            server.check_vllm_server(url, timeout_s=5)


def test_a_healthy_gpu_server_passes_and_a_wrong_logprobs_mode_warns():
    with stub_server({**HEALTHY, "/server_info": (200, info(logprobs_mode="raw_logprobs"))}) as url:
        rep = server.check_vllm_server(url, timeout_s=5)
    assert rep.world_size == 1 and rep.model == "Qwen/Qwen3-0.6B" and rep.server_has_cuda is True
    assert rep.warnings and "processed_logprobs" in rep.warnings[0]


def test_an_unhealthy_server_times_out_with_what_to_check():
    with stub_server({"/health": (503, {})}) as url:
        with pytest.raises(server.VLLMPreflightError, match="docker compose logs vllm"):
            server.wait_healthy(url, timeout_s=1, poll_s=0.2)


def test_version_skew_between_trainer_and_server_is_an_error():
    rep = server.ServerReport(url="x", vllm_version="0.31.0", torch_version="2.13.0+cu130")
    assert server.version_skew(rep, "0.31.0", "2.13.0+cu130") == []
    problems = server.version_skew(rep, "0.30.0", "2.12.0+cu129")
    assert len(problems) == 2 and all("VLLM_IMAGE" in p for p in problems)


def test_init_failures_are_explained():
    gpuless = server.ServerReport(url="x", server_has_cuda=False, torch_version="2.13.0+cpu")
    assert "the vLLM server has no GPU" in server.explain_init_failure(500, "", gpuless)
    assert "no CUDA device" in server.explain_init_failure(
        None, "Weight synchronization ... needs a CUDA device, got 'cpu'.", None)
    assert "--weight-transfer-config" in server.explain_init_failure(
        500, "Weight transfer not configured.", None)


def test_guard_wraps_trls_init_communicator_with_a_clear_error_test_double_for_nccl_init(monkeypatch):
    import trl.generation.vllm_client as trl_vllm_client

    def failing(self, device=0):
        raise Exception("Request failed: 500, {\"error\": \"Cannot access accelerator device when none is available.\"}")

    monkeypatch.setattr(trl_vllm_client.VLLMClient, "init_communicator", failing)
    trl_hooks.guard_weight_transfer_init(5, "172.20.0.7", 51216, None)
    trl_hooks.guard_weight_transfer_init(5, "172.20.0.7", 51216, None)  # idempotent
    with pytest.raises(trl_hooks.WeightTransferInitError, match="the vLLM server has no GPU"):
        trl_vllm_client.VLLMClient.init_communicator(object())


def test_guard_turns_a_hung_rendezvous_into_a_diagnosis_test_double_for_nccl_init(monkeypatch):
    import trl.generation.vllm_client as trl_vllm_client

    def hangs(self, device=0):
        for _ in range(1000):
            time.sleep(0.01)

    monkeypatch.setattr(trl_vllm_client.VLLMClient, "init_communicator", hangs)
    trl_hooks.guard_weight_transfer_init(0.3, "172.20.0.7", 51216, None)
    with pytest.raises(watchdog.WeightSyncTimeout, match="172.20.0.7:51216"):
        trl_vllm_client.VLLMClient.init_communicator(object())
