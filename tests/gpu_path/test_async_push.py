"""ROLLOUTS=async with TRL 1.16's own NCCL client (WeightTransferClient, rank 0), without vLLM or a GPU: the manifest vLLM
sizes its receive buffers by and the stream are cast to the served dtype together (the trainer keeps fp32 masters), and
each push is marked in flight (trainer.gpu.push_state) as the sync trainer's are."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from contextlib import contextmanager  # noqa: E402
from http.server import BaseHTTPRequestHandler  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import JsonStubHandler, stub_http_server  # noqa: E402
from trainer.gpu import push_state, trl_hooks  # noqa: E402
from trainer.gpu.weight_check import PrefixCacheResetFailed  # noqa: E402


@contextmanager
def stub_vllm(calls: list, success: bool = True):
    """An in-process stand-in for vLLM's /reset_prefix_cache on 127.0.0.1: records each call (path with its query)
    and answers `{"success": ...}` as vLLM 0.31 does."""
    class Handler(JsonStubHandler, BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            calls.append(("POST", self.path))
            self.reply(200, {"success": success})

    with stub_http_server(Handler) as url:
        yield url


@pytest.fixture
def vllm_calls():
    calls: list = []
    with stub_vllm(calls) as url:
        yield url, calls


def bare_client(manifest: dict, sent: list, marker_dir, url: str):
    """TRL's client with only what the hook touches: the manifest, send_weights, init_weight_transfer and its vLLM
    client's server_url."""
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    client = object.__new__(WeightTransferClient)  # its __init__ needs vLLM installed
    client._weight_update_info = manifest
    client.vllm = SimpleNamespace(server_url=url)

    def send_weights(iterator):  # what packed_nccl_broadcast_producer would read: every tensor, in order
        for name, tensor in iterator:
            sent.append((name, str(tensor.dtype).removeprefix("torch."), push_state.read(str(marker_dir))["state"]))

    client.send_weights, client.init_weight_transfer = send_weights, lambda: None
    return client


def test_async_nccl_pushes_go_in_the_served_dtype_in_manifest_and_stream_and_are_marked(tmp_path, monkeypatch,
                                                                                         vllm_calls):
    import torch

    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    sent: list = []
    manifest = {"names": ["w", "steps"], "dtype_names": ["float32", "int64"], "shapes": [[2, 2], [1]]}
    client = bare_client(manifest, sent, tmp_path, vllm_calls[0])
    assert trl_hooks.async_nccl_push(client, "bfloat16")
    assert manifest["dtype_names"] == ["bfloat16", "int64"]  # what vLLM allocates by
    client.init_weight_transfer()
    assert push_state.read(str(tmp_path))["state"] == "group"
    client.send_weights(iter([("w", torch.ones(2, 2)), ("steps", torch.ones(1, dtype=torch.int64))]))
    assert sent == [("w", "bfloat16", "push"), ("steps", "int64", "push")]  # marked in flight while it streams
    assert [dtype for _, dtype, _ in sent] == manifest["dtype_names"]
    assert push_state.read(str(tmp_path))["state"] == "group"
    assert not trl_hooks.async_nccl_push(client, "bfloat16")  # wrapped once


def test_async_push_without_a_served_dtype_goes_as_it_is_and_other_transfers_are_left_alone(tmp_path, monkeypatch,
                                                                                              vllm_calls):
    import torch

    from trainer.async_grpo.async_trainer import ReloadWeightTransfer

    monkeypatch.setattr(push_state, "_STATE", {})
    sent: list = []
    manifest = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    push_state.configure(str(tmp_path), "run-a")
    client = bare_client(manifest, sent, tmp_path, vllm_calls[0])
    assert trl_hooks.async_nccl_push(client, None)
    client.send_weights(iter([("w", torch.ones(2))]))
    assert manifest["dtype_names"] == ["float32"] and sent == [("w", "float32", "push")]
    assert not trl_hooks.async_nccl_push(object.__new__(ReloadWeightTransfer), "bfloat16")  # casts and marks its own
    assert not trl_hooks.async_nccl_push(None, "bfloat16")  # ranks other than 0, LoRA's adapter sync


def test_async_push_resets_the_prefix_cache_with_the_paused_requests_before_resume(tmp_path, monkeypatch):
    """#42 item 9: TRL pauses with mode=keep and never resets; the paused requests hold cache blocks, so the reset
    asks vLLM to drop theirs too (reset_running_requests) after the weights went in and before the push counts as
    done (TRL resumes after send_weights returns)."""
    import torch

    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    calls: list = []
    with stub_vllm(calls) as url:
        sent: list = []
        client = bare_client({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}, sent, tmp_path, url)
        send = client.send_weights
        client.send_weights = lambda it: (send(it), calls.append(("sent", len(sent))))
        assert trl_hooks.async_nccl_push(client, "bfloat16")
        client.send_weights(iter([("w", torch.ones(2))]))
        client.send_weights(iter([("w", torch.ones(2))]))
    reset = ("POST", "/reset_prefix_cache?reset_running_requests=true")
    assert calls == [("sent", 1), reset, ("sent", 2), reset]  # one checked reset after each push's last tensor


def test_a_refused_async_reset_stops_the_push_with_its_reason(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    calls: list = []
    with stub_vllm(calls, success=False) as url:
        client = bare_client({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}, [], tmp_path, url)
        assert trl_hooks.async_nccl_push(client, None)
        with pytest.raises(PrefixCacheResetFailed, match="did not reset its prefix cache"):
            client.send_weights(iter([("w", torch.ones(2))]))
    assert push_state.read(str(tmp_path))["state"] == "push"  # left marked: the next launch restarts vLLM


def test_the_async_reload_push_resets_the_prefix_cache_too(tmp_path, monkeypatch):
    from trainer.async_grpo import async_trainer

    monkeypatch.setattr(push_state, "_STATE", {})
    monkeypatch.setattr(trl_hooks, "reload_weights", lambda *a: 1)
    calls: list = []
    with stub_vllm(calls) as url:
        transfer = async_trainer.ReloadWeightTransfer(url, str(tmp_path), 30.0, None)
        transfer.send_weights(iter([]))
    assert calls == [("POST", "/reset_prefix_cache?reset_running_requests=true")]
