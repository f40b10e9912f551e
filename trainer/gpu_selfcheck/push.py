"""The weight push's side of the self-check: training's push iterator through vLLM's packed sender and receiver
(`weight_iterator`, needs vLLM), and a LoRA push's order through a torch-only copy of that sender's two-stream loop
(`lora_push_order`: trainer.gpu.push_path.merge_before_push)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from trainer.gpu_selfcheck.base import Result, qwen3_config


class LoopbackGroup:
    """The `group` vLLM's packed producer and consumer broadcast over (PyNcclCommunicator's `broadcast(tensor,
    src)`), in one process: what the producer (rank 0) broadcasts is kept, in order, and handed to the consumer's
    receive buffers. Sizes must match buffer for buffer, as NCCL's would."""

    def __init__(self) -> None:
        self.sent: list = []
        self.receiving = False
        self.received = 0

    def broadcast(self, tensor, src: int = 0, stream=None) -> None:
        if not self.receiving:
            self.sent.append(tensor.detach().clone())
            return
        if self.received >= len(self.sent):
            raise RuntimeError("the consumer expects more buffers than the producer sent")
        data = self.sent[self.received]
        if data.numel() != tensor.numel():
            raise RuntimeError(f"buffer {self.received}: the producer sent {data.numel()} bytes, the consumer "
                               f"expects {tensor.numel()}")
        tensor.copy_(data)
        self.received += 1


@contextlib.contextmanager
def cpu_streams(packed_tensor):
    """--device cpu: vLLM's packed transfer pins CUDA streams; stand in no-op ones so the same code runs."""
    import torch

    class Stream:
        def synchronize(self) -> None:
            pass

    saved = packed_tensor._get_streams, torch.accelerator.current_device_index
    packed_tensor._get_streams = lambda device_idx, num_buffers: tuple(Stream() for _ in range(num_buffers))
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        packed_tensor._get_streams, torch.accelerator.current_device_index = saved


SERVED_DTYPE = "bfloat16"  # what vLLM's dtype "auto" serves a Qwen3 checkpoint in on a GPU that has bf16


def trl_weight_iterator(model, served_dtype: str | None = SERVED_DTYPE, qlora: bool = False):
    """Training's push iterator (trainer.gpu.push_path: TRL 1.16's VLLMGeneration._iter_named_params with the stack's
    QLoRA and served-dtype hooks), on a VLLMGeneration without a vLLM engine."""
    from trainer.gpu import push_path

    return push_path.generation(model, served_dtype, qlora=qlora)._iter_named_params


def check_weight_iterator(device, tiny: bool) -> Result:
    try:
        from vllm.distributed.weight_transfer import packed_tensor
    except Exception as exc:  # noqa: BLE001 - ImportError, or a vLLM build that fails to import here
        return Result("weight_iterator", "SKIP", f"(vLLM not importable here: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}; run it where vLLM 0.31 is installed)")
    import torch
    from safetensors import safe_open
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(tiny)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.float32)  # fp32 master weights, as training
    iterate = trl_weight_iterator(model)  # cast to SERVED_DTYPE on the way, as training's pushes are
    served = getattr(torch, SERVED_DTYPE)
    # TRL's server mode: metadata from a first pass, then the stream (vllm_client.update_named_params / the worker's
    # NCCLWeightTransferEngine.receive_weights).
    metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in iterate()]
    total = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for _, d, s in metadata)
    buffer = max(1, min(packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES, total // 3))  # at least 3 chunks
    group = LoopbackGroup()
    received: list[tuple[str, torch.Tensor]] = []

    def consume(pairs):  # the worker's post_unpack_func is model.load_weights; here: keep a copy of each tensor
        received.extend((n, t.clone()) for n, t in pairs)

    def info():
        for name, dtype_name, shape in metadata:
            yield name, (shape, getattr(torch, dtype_name))

    streams = cpu_streams(packed_tensor) if device.type == "cpu" else contextlib.nullcontext()
    t0 = time.monotonic()
    with streams, torch.no_grad():
        packed_tensor.packed_nccl_broadcast_producer(iterator=iterate(), group=group, src=0,
                                                     post_iter_func=lambda item: item[1], buffer_size_bytes=buffer)
        group.receiving = True
        packed_tensor.packed_nccl_broadcast_consumer(iterator=info(), group=group, src=0, post_unpack_func=consume,
                                                     buffer_size_bytes=buffer, device=device)
    took = time.monotonic() - t0
    problems = []
    if group.received != len(group.sent):
        problems.append(f"{len(group.sent)} buffers sent, {group.received} received")
    params = dict(model.named_parameters())
    names = [n for n, _ in received]
    identical = sum(torch.equal(t.view(torch.uint8).flatten(), params[n].detach().to(served).contiguous()
                                .view(torch.uint8).flatten()) for n, t in received if n in params)
    if identical != len(params) or len(received) != len(params):
        problems.append(f"{identical} of {len(params)} tensors byte-identical ({len(received)} received)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"sent more than once: {', '.join(dupes[:3])}")
    with tempfile.TemporaryDirectory(prefix="selfcheck-ckpt-") as tmp:  # the names vLLM's loader reads from disk
        model.save_pretrained(tmp)
        expected = set()
        for path in Path(tmp).glob("*.safetensors"):
            with safe_open(str(path), "pt") as fh:
                expected |= set(fh.keys())
    if set(names) != expected:
        extra, missing = sorted(set(names) - expected), sorted(expected - set(names))
        problems.append(f"names differ from the checkpoint's: extra {extra[:3]}, missing {missing[:3]}")
    tied = config.tie_word_embeddings and "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    if config.tie_word_embeddings and not tied:
        problems.append("tied embeddings: lm_head.weight sent or model.embed_tokens.weight missing")
    detail = (f"{len(received)} tensors, {total / 1e6:.1f} MB in {len(group.sent)} packed buffers of <= "
              f"{buffer / 1e6:.1f} MB, {took:.2f} s; byte-identical to the fp32 weights cast to {SERVED_DTYPE} "
              f"{identical}/{len(params)}; tied embeddings sent "
              f"once as model.embed_tokens.weight: {'yes' if tied else 'no'}; names = checkpoint's: "
              f"{'yes' if set(names) == expected else 'no'}")
    if problems:
        detail += "; " + "; ".join(problems)
    return Result("weight_iterator", "FAIL" if problems else "PASS", detail,
                  {"tensors": len(received), "buffers": len(group.sent), "seconds": took})


# ---------------------------------------------------------------------------- LoRA push order
def pack_chunk(iterator, buffer_size_bytes: int):
    """vLLM 0.31's `packed_tensor.pack_tensors` (post_iter_func = the tensor, as TRL passes it), torch only: take
    tensors until the chunk passes the buffer size, then one `torch.cat` of their bytes. None when none is left."""
    import torch

    tensors, total = [], 0
    for _, tensor in iterator:
        flat = tensor.contiguous().view(torch.uint8).view(-1)
        tensors.append(flat)
        total += flat.numel()
        if total > buffer_size_bytes:
            break
    return torch.cat(tensors, dim=0) if tensors else None


def two_stream_producer(iterator, group, buffer_size_bytes: int, streams) -> None:
    """vLLM 0.31's `packed_nccl_broadcast_producer`, torch only, line for line: each chunk is packed and broadcast on
    the next of `streams` (two: double buffering), which synchronizes only with its own previous chunk; `streams`
    None: everything on the current stream (the reference)."""
    import torch

    slots = streams or [None, None]
    in_flight = [None] * len(slots)
    idx = 0
    while True:
        if slots[idx] is not None:
            slots[idx].synchronize()
        in_flight[idx] = None
        with torch.cuda.stream(slots[idx]) if slots[idx] is not None else contextlib.nullcontext():
            chunk = pack_chunk(iterator, buffer_size_bytes)
            if chunk is None:
                break
            group.broadcast(chunk, src=0)
            in_flight[idx] = chunk
            idx = (idx + 1) % len(slots)
    for stream in slots:
        if stream is not None:
            stream.synchronize()


class PackedSender:
    """Stands in for TRL's VLLMClient in a push: `update_named_params` runs the two-stream loop into a loopback."""

    def __init__(self, buffer_size_bytes: int, streams) -> None:
        self.buffer, self.streams, self.sent = buffer_size_bytes, streams, []

    def update_named_params(self, metadata, named_params) -> None:
        group = LoopbackGroup()
        two_stream_producer(iter(named_params), group, self.buffer, self.streams)
        self.sent = group.sent

    def reset_prefix_cache(self) -> None:
        pass


LORA_PUSHES = 20


def check_lora_push_order(device, tiny: bool) -> Result:
    """A LoRA model's weight push through training's hooks (trainer.gpu.push_path: the merge complete before the first
    read, the unmerge after the last) and a torch-only copy of vLLM's two-stream packing loop, 20 times, byte for
    byte against the same push packed on the default stream. Also reported, not judged: TRL's own lazy order
    (no hook) through the same loop. The base weights are restored before every push (merge/unmerge rounds)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from trainer.gpu import push_path

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(tiny)).to(device=device, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # a trained adapter: the merge moves every adapted weight
    pristine = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(p.numel() * 2 for n, p in model.named_parameters() if ".lora_" not in n)  # bf16 bytes, about
    buffer = max(1 << 16, total // 16)  # ~16 chunks: many hand-overs between the two streams
    cuda = device.type == "cuda"

    def restore() -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(pristine[n])

    sender = PackedSender(buffer, None)
    gen = push_path.generation(model, SERVED_DTYPE, client=sender)  # training's hooks (merge order, bf16 cast)

    def push(streams, hooked: bool = True):
        restore()
        sender.streams, sender.sent = streams, []
        (gen.sync_weights if hooked else gen.sync_weights.__wrapped__)()  # __wrapped__: TRL's own, lazy merge
        if cuda:
            torch.cuda.synchronize(device)
        return torch.cat(sender.sent)

    reference = push(None)
    streams = [torch.cuda.Stream(device) for _ in range(2)] if cuda else None
    t0 = time.monotonic()
    differ = sum(not torch.equal(push(streams), reference) for _ in range(LORA_PUSHES))
    took = time.monotonic() - t0
    unhooked = sum(not torch.equal(push(streams, hooked=False), reference) for _ in range(LORA_PUSHES))
    restore()
    where = "two CUDA side streams" if cuda else "no side streams on the CPU (the race needs a GPU)"
    detail = (f"LoRA r=16 all-linear, {'tiny' if tiny else 'Qwen3-0.6B'} shape, {reference.numel() / 1e6:.1f} MB "
              f"in bf16 per push, ~16 packed chunks, {where}: {LORA_PUSHES - differ}/{LORA_PUSHES} pushes "
              f"byte-identical to the default-stream reference through training's hook ({took:.1f} s); TRL's lazy "
              f"merge without the hook: {LORA_PUSHES - unhooked}/{LORA_PUSHES} identical")
    return Result("lora_push_order", "FAIL" if differ else "PASS", detail,
                  {"pushes": LORA_PUSHES, "differ": differ, "differ_without_hook": unhooked, "bytes": reference.numel()})
