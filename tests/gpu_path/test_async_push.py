"""ROLLOUTS=async with TRL 1.16's own NCCL client (WeightTransferClient, rank 0), without vLLM or a GPU: the manifest vLLM
sizes its receive buffers by and the stream are cast to the served dtype together (the trainer keeps fp32 masters), and
each push is marked in flight (trainer.gpu.push_state) as the sync trainer's are."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trainer.gpu import push_state, trl_hooks  # noqa: E402


def bare_client(manifest: dict, sent: list, marker_dir):
    """TRL's client with only what the hook touches: the manifest, send_weights and init_weight_transfer."""
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    client = object.__new__(WeightTransferClient)  # its __init__ needs vLLM installed
    client._weight_update_info = manifest

    def send_weights(iterator):  # what packed_nccl_broadcast_producer would read: every tensor, in order
        for name, tensor in iterator:
            sent.append((name, str(tensor.dtype).removeprefix("torch."), push_state.read(str(marker_dir))["state"]))

    client.send_weights, client.init_weight_transfer = send_weights, lambda: None
    return client


def test_async_nccl_pushes_go_in_the_served_dtype_in_manifest_and_stream_and_are_marked(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(push_state, "_STATE", {})
    push_state.configure(str(tmp_path), "run-a")
    sent: list = []
    manifest = {"names": ["w", "steps"], "dtype_names": ["float32", "int64"], "shapes": [[2, 2], [1]]}
    client = bare_client(manifest, sent, tmp_path)
    assert trl_hooks.async_nccl_push(client, "bfloat16")
    assert manifest["dtype_names"] == ["bfloat16", "int64"]  # what vLLM allocates by
    client.init_weight_transfer()
    assert push_state.read(str(tmp_path))["state"] == "group"
    client.send_weights(iter([("w", torch.ones(2, 2)), ("steps", torch.ones(1, dtype=torch.int64))]))
    assert sent == [("w", "bfloat16", "push"), ("steps", "int64", "push")]  # marked in flight while it streams
    assert [dtype for _, dtype, _ in sent] == manifest["dtype_names"]
    assert push_state.read(str(tmp_path))["state"] == "group"
    assert not trl_hooks.async_nccl_push(client, "bfloat16")  # wrapped once


def test_async_push_without_a_served_dtype_goes_as_it_is_and_other_transfers_are_left_alone(tmp_path, monkeypatch):
    import torch

    from trainer.run.async_trainer import ReloadWeightTransfer

    monkeypatch.setattr(push_state, "_STATE", {})
    sent: list = []
    manifest = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    push_state.configure(str(tmp_path), "run-a")
    client = bare_client(manifest, sent, tmp_path)
    assert trl_hooks.async_nccl_push(client, None)
    client.send_weights(iter([("w", torch.ones(2))]))
    assert manifest["dtype_names"] == ["float32"] and sent == [("w", "float32", "push")]
    assert not trl_hooks.async_nccl_push(object.__new__(ReloadWeightTransfer), "bfloat16")  # casts and marks its own
    assert not trl_hooks.async_nccl_push(None, "bfloat16")  # ranks other than 0, LoRA's adapter sync
