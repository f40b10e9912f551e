"""GPU self-check without Docker, vLLM server or the Hub: `python -m trainer.gpu_selfcheck` (`make gpu-selfcheck`).

Checks the trainer's CUDA path in a plain Python environment (torch, trl, transformers, accelerate, datasets,
openenv; docs/gpu-host.md "GPU self-check"), one line each, `PASS` / `FAIL` / `SKIP (why)` with its figures:

  master_weights   a model of Qwen3-0.6B's shape, random init, 3 AdamW steps at lr 1e-5, with bf16 and with fp32
                   master weights: the fraction of elements each step changed, per parameter group
  trainer_loop     the project's trainer class and rollout loop (trainer.run.grpo_trainer.make_trainer_class), 2 GRPO steps
                   against the echo env server on 127.0.0.1, generation by transformers: memory peak, step time
  colocate_budget  Qwen3-0.6B's shape at the default batch and lengths, gradient checkpointing as training sets it:
                   memory peak after forward, backward and the optimizer step, and what is left for vLLM on 24, 48, 80
                   and 141 GB cards
  weight_iterator  (vLLM importable) training's push iterator (trainer.gpu.push_path: TRL's, fp32 weights cast to
                   bf16) through vLLM's packed producer and consumer over a loopback: bytes identical, tied
                   embeddings sent once, exactly the checkpoint's names

Without CUDA the checks SKIP; `--device cpu` runs the same code on the CPU at a tiny size (the CI test does). The
process pins itself to one GPU first (pin_one_gpu), whatever the box has.
Exit code 0 when nothing FAILed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from trainer.core import grpo_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

GB = 1e9
CARDS_GB = (24, 48, 80, 141)
LR = 1e-5  # the GPU default learning rate (contract.config.GPU_DEFAULT_LR)
ADAM_STEPS = 3
# What the echo prompt takes with its tool schema rendered is about 200 tokens; 512 leaves room for longer envs.
PROMPT_TOKENS = 512
# fp32 master weights must move nearly every element at lr 1e-5; bf16 ones are reported, not judged.
MIN_FP32_CHANGED = 0.9
# Per-check time bounds (seconds, on a GPU); the whole command stays under 8 minutes.
BUDGET_S = {"master_weights": 90, "trainer_loop": 240, "colocate_budget": 90, "weight_iterator": 60}


class CheckTimeout(Exception):
    pass


@dataclass
class Result:
    name: str
    verdict: str  # PASS, FAIL, SKIP
    detail: str
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.verdict:<4} {self.name}: {self.detail}"


# ---------------------------------------------------------------------------- shapes
def qwen3_config(tiny: bool, vocab_size: int | None = None):
    """Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), or trainer.tiny_model's tiny one."""
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=vocab_size or 1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                           tie_word_embeddings=True, bos_token_id=None)
    return Qwen3Config(vocab_size=vocab_size or 151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None)


def param_group(name: str) -> str:
    """Parameter groups of a Qwen3 decoder, by the name's last parts."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embed"
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attn"
    if any(k in name for k in ("gate_proj", "up_proj", "down_proj")):
        return "mlp"
    return "norm"  # input/post-attention layernorms, q_norm/k_norm, the final norm


def autocast(device):
    """What GRPOConfig(bf16=True) does on a GPU: bf16 autocast around fp32 (or bf16) weights."""
    import torch

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def changed_fractions(model, before: dict) -> dict[str, float]:
    """Per parameter group: the fraction of elements that differ from `before`."""
    changed: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, p in model.named_parameters():
        group = param_group(name)
        changed[group] = changed.get(group, 0) + int((p.detach() != before[name]).sum().item())
        total[group] = total.get(group, 0) + p.numel()
    return {g: changed[g] / total[g] for g in sorted(total)}


def adam_steps(config, device, dtype, steps: int, batch: int, seq: int, seed: int = 0) -> dict[str, float]:
    """Random-init model in `dtype`, `steps` AdamW steps at lr 1e-5 on random tokens: fractions changed per group."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # transformers' default decay is 0
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    fractions = changed_fractions(model, before)
    del model, before, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fractions


# ---------------------------------------------------------------------------- 1. master weights
def check_master_weights(device, tiny: bool) -> Result:
    import torch

    config = qwen3_config(tiny)
    seq = 32 if tiny else 128
    bf16 = adam_steps(config, device, torch.bfloat16, ADAM_STEPS, 2, seq)
    fp32 = adam_steps(config, device, torch.float32, ADAM_STEPS, 2, seq)

    def show(fr):
        return " ".join(f"{g} {v:.1%}" for g, v in fr.items())

    worst = min(fp32.values())
    verdict = "PASS" if worst >= MIN_FP32_CHANGED else "FAIL"
    detail = (f"{ADAM_STEPS} AdamW steps at lr {LR:g}, {'tiny' if tiny else 'Qwen3-0.6B'} shape; elements changed: "
              f"fp32 master [{show(fp32)}], bf16 master [{show(bf16)}]")
    if verdict == "FAIL":
        detail += f"; fp32 moved only {worst:.1%} of a group (< {MIN_FP32_CHANGED:.0%}): the optimizer is not updating"
    elif min(bf16.values()) < 0.5:
        detail += "; bf16 weights mostly round back to themselves at this lr: train with fp32 master weights"
    return Result("master_weights", verdict, detail, {"fp32": fp32, "bf16": bf16})


# ---------------------------------------------------------------------------- 2. trainer loop
def make_tiny_model(out: Path, url: str, seed: int = 1234) -> None:
    """trainer.tiny_model's tokenizer and model (the CPU profile's init job) without its warm-start: a loop check
    needs a model, not one that calls tools."""
    from trl.chat_template_utils import get_training_chat_template

    from envs import registry
    from trainer import tiny_model

    convs = tiny_model.build_conversations("echo", registry.get("echo"), url, 16, seed)
    probe = tiny_model.make_tokenizer(["hello"], 300)
    template = get_training_chat_template(probe)
    corpus = [probe.apply_chat_template(d.messages, tools=d.tools, chat_template=template, tokenize=False)
              for d in convs]
    tokenizer = tiny_model.make_tokenizer(corpus, 1024)
    model = tiny_model.make_model(tokenizer, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_trainer_loop(device, tiny: bool) -> Result:
    import torch

    from envs import registry
    from trainer import tiny_model
    from contract.config import ColocateMode, CpuMode, RunConfig, default
    from trainer.rollouts.envs_binding import build_factories
    from trainer.core.metrics import STATS, MetricsCallback, read_metrics
    from trainer.core.trackers import RunInfo, Trackers
    from trainer.run.dataset import build_dataset
    from trainer.modeling.model import load_model_and_tokenizer
    from trainer.run.grpo_trainer import make_trainer_class

    with tempfile.TemporaryDirectory(prefix="selfcheck-") as tmp:
        model_dir = Path(tmp) / "tiny-qwen3"
        batch = default("per_device_train_batch_size")
        with tiny_model.local_env_server("echo", max_sessions=2 * batch) as url:  # TRL's pool, with room
            t0 = time.monotonic()
            make_tiny_model(model_dir, url)
            build_s = time.monotonic() - t0
            argv = ["--env-name", "echo", "--env-urls", f"echo={url}", "--model-name", str(model_dir),
                    "--output-dir", str(Path(tmp) / "runs"), "--run-name", "selfcheck", "--max-steps", "2",
                    "--trace-every", "0", "--report-to", "none", "--save-steps", "1000", "--dataset-size", "32"]
            if device.type == "cpu":
                argv += ["--max-completion-length", "96"]  # a busy CI box: same code, shorter episodes
            # cpu: the CPU profile; cuda: the GPU settings (bf16 autocast where supported), transformers generation.
            cfg = RunConfig.load(argv).resolved(CpuMode() if device.type == "cpu" else ColocateMode())
            training_args = grpo_args.grpo_config(cfg, use_vllm=False)
            model, tokenizer = load_model_and_tokenizer(cfg)
            load_dtype = str(model.dtype).removeprefix("torch.")
            specs = {"echo": registry.get("echo")}
            trainer_cls = make_trainer_class()
            metrics = MetricsCallback(cfg.run_dir, STATS, mode=cfg.placement,
                                      print_fn=lambda line: print(line, file=sys.stderr), trackers=Trackers([], RunInfo(cfg.run_dir, "selfcheck", cfg.output_dir)))
            trainer = trainer_cls(model=model, args=training_args, train_dataset=build_dataset(cfg, specs),
                                  processing_class=tokenizer, environment_factory=build_factories(cfg, specs, STATS),
                                  callbacks=[metrics])
            trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency)
            from transformers.trainer_callback import PrinterCallback

            trainer.remove_callback(PrinterCallback)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with contextlib.redirect_stdout(sys.stderr):
                trainer.train()
            on = str(next(trainer.model.parameters()).device)
            peak = torch.cuda.max_memory_allocated() / GB if device.type == "cuda" else None
            rows = read_metrics(cfg.run_dir)
    steps = trainer.state.global_step
    step_s = [r["time/step_s"] for r in rows if isinstance(r.get("time/step_s"), (int, float))]
    calls = [r.get("tools/call_frequency") or 0 for r in rows]
    losses = [r.get("loss") for r in rows]
    ok = steps == 2 and on.startswith(device.type) and all(isinstance(x, (int, float)) for x in losses)
    mem = f"peak {peak:.2f} GB" if peak is not None else "peak n/a on CPU"
    detail = (f"{steps} GRPO steps on {on} (weights loaded as {load_dtype}), {mem}, step time "
              + "/".join(f"{s:.1f}" for s in step_s) + f" s, tool calls/episode {sum(calls) / max(1, len(calls)):.2f}, "
              f"loss {'/'.join('-' if x is None else f'{x:.4f}' for x in losses)} (tiny model built in {build_s:.0f} s)")
    if not ok:
        detail += f"; expected 2 steps on {device.type} with a loss each"
    return Result("trainer_loop", "PASS" if ok else "FAIL", detail,
                  {"steps": steps, "peak_gb": peak, "step_s": step_s, "device": on, "load_dtype": load_dtype})


# ---------------------------------------------------------------------------- 3. colocate budget
def colocate_fits(card_gb: float, trainer_peak_gb: float, context_gb: float, share: float) -> tuple[float, bool]:
    """What a card leaves for vLLM beside the trainer's peak and the CUDA context, and whether vLLM's share fits
    (TRL starts vLLM first; it takes share x card, then training grows to its peak)."""
    left = card_gb - trainer_peak_gb - context_gb
    return left, left >= share * card_gb


def tensor_bytes(model, opt) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "numel"))
    return total


def check_colocate_budget(device, tiny: bool) -> Result:
    import torch
    from transformers import Qwen3ForCausalLM
    from trl.trainer.utils import selective_log_softmax

    from contract.config import default

    batch = default("per_device_train_batch_size")
    completion = default("max_completion_length")
    prompt = 64 if tiny else PROMPT_TOKENS
    if tiny:
        batch, completion = 2, 32
    config = qwen3_config(tiny)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.float32)  # fp32 master weights
    checkpointing = checkpoint_as_training(model, training_args(device))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids = torch.randint(0, config.vocab_size, (batch, prompt + completion), device=device)
    peaks = {}

    def peak() -> float:
        return torch.cuda.max_memory_allocated() / GB if cuda else tensor_bytes(model, opt) / GB

    peaks["weights"] = peak()
    with autocast(device):  # as TRL's loss: logits of the completion only, log-softmax of the sampled tokens
        logits = model(input_ids=ids, logits_to_keep=completion + 1).logits[:, :-1, :]
        logps = selective_log_softmax(logits, ids[:, -completion:])
        loss = -logps.mean()
    peaks["forward"] = peak()
    loss.backward()
    del logits, logps, loss
    peaks["backward"] = peak()
    opt.step()
    opt.zero_grad(set_to_none=False)
    peaks["optimizer"] = peak()
    trainer_peak = max(peaks.values())
    context = 0.0
    this_card = None
    if cuda:
        free, total = torch.cuda.mem_get_info()
        context = max(0.0, (total - free - torch.cuda.memory_reserved()) / GB)
        this_card = total / GB
    del model, opt, ids
    if cuda:
        torch.cuda.empty_cache()
    share = _gpu_memory_share_default()
    cards = []
    for card in CARDS_GB:
        left, fits = colocate_fits(card, trainer_peak, context, share)
        cards.append(f"{card} GB: {left:.1f} left ({'fits' if fits else 'short of'} vLLM's {share * card:.1f})")
    what = "tiny shape, tensor bytes (activations not counted on CPU)" if tiny or not cuda else "Qwen3-0.6B shape"
    detail = (f"{what}, batch {batch} x ({prompt} prompt + {completion} completion) tokens, fp32 weights + AdamW, "
              f"gradient checkpointing {'on' if checkpointing else 'off'} (as training): "
              f"peak GB weights {peaks['weights']:.2f}, forward {peaks['forward']:.2f}, backward {peaks['backward']:.2f},"
              f" optimizer {peaks['optimizer']:.2f}; CUDA context and other processes {context:.2f}; left for vLLM at "
              f"VLLM_GPU_MEMORY_UTILIZATION={share:g}: " + "; ".join(cards))
    verdict = "PASS"
    if this_card is not None:
        left, fits = colocate_fits(this_card, trainer_peak, context, share)
        detail += f"; this card ({this_card:.0f} GB): {left:.1f} left"
        if not fits:
            verdict = "FAIL"
            detail += (f", short of vLLM's {share * this_card:.1f}: lower PER_DEVICE_TRAIN_BATCH_SIZE or "
                       "MAX_COMPLETION_LENGTH, or use TRAIN_MODE=gpu with a second GPU")
    return Result("colocate_budget", verdict, detail, {"peaks_gb": peaks, "context_gb": context, "share": share,
                                                       "gradient_checkpointing": checkpointing})


def training_args(device):
    """The GRPOConfig training builds for this device with the default settings (grpo_args.grpo_config)."""
    from contract.config import ColocateMode, CpuMode, RunConfig

    cfg = RunConfig.load([]).resolved(CpuMode() if device.type == "cpu" else ColocateMode())
    return grpo_args.grpo_config(cfg, use_vllm=False)


def checkpoint_as_training(model, args) -> bool:
    """Gradient checkpointing as transformers' Trainer.__init__ (5.17) turns it on from the training arguments (TRL's
    GRPOConfig defaults it on; activations then cost a fraction of a full forward's). Returns whether it is on."""
    if not args.gradient_checkpointing:
        return False
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers,
                                        offload=offload)
    return model.is_gradient_checkpointing


def _gpu_memory_share_default() -> float:
    """Colocate's vLLM share as training would use it (trainer.gpu.grpo_kwargs: VLLM_GPU_MEMORY_UTILIZATION, else
    its colocate default)."""
    from contract.config import ColocateMode, RunConfig

    return RunConfig.load([]).resolved(ColocateMode()).vllm_memory_share


# ---------------------------------------------------------------------------- 4. weight iterator
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


# ---------------------------------------------------------------------------- runner
CHECKS: dict[str, Callable] = {
    "master_weights": check_master_weights,
    "trainer_loop": check_trainer_loop,
    "colocate_budget": check_colocate_budget,
    "weight_iterator": check_weight_iterator,
}


@contextlib.contextmanager
def time_bound(seconds: float):
    """Stop a check that runs past its bound (SIGALRM in the main thread)."""
    def expire(signum, frame):
        raise CheckTimeout(f"took longer than its bound of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, device, tiny: bool, bound_s: float) -> Result:
    t0 = time.monotonic()
    try:
        with time_bound(bound_s):
            result = CHECKS[name](device, tiny)
    except Exception as exc:  # noqa: BLE001 - one FAIL line per check, the traceback on stderr
        import traceback

        traceback.print_exc(file=sys.stderr)
        first = str(exc).splitlines()[0] if str(exc) else ""
        result = Result(name, "FAIL", f"{type(exc).__name__}: {first}")
    result.detail += f" [{time.monotonic() - t0:.0f} s]"
    return result


def resolve_device(choice: str):
    """cuda / cpu as asked; auto: cuda when torch sees one, else None (the CUDA checks SKIP)."""
    import torch

    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("selfcheck: --device cuda, but torch sees no CUDA device (torch "
                             f"{torch.__version__}, built for CUDA {torch.version.cuda}): install a CUDA build of torch "
                             "or check the driver (nvidia-smi)")
        return torch.device("cuda", torch.cuda.current_device())
    return None


def pin_one_gpu(environ=os.environ) -> str | None:
    """Make this process see one GPU (the first CUDA_VISIBLE_DEVICES names, else GPU 0) before CUDA initialises:
    the checks measure one card, and transformers would count every visible GPU into `n_gpu` (nn.DataParallel).
    Returns a note when it narrowed the list; an empty CUDA_VISIBLE_DEVICES (no GPU) stays as it is."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None and "," not in value:
        return None
    first = "0" if value is None else value.split(",")[0].strip()
    environ["CUDA_VISIBLE_DEVICES"] = first
    return f"CUDA_VISIBLE_DEVICES={first} (was {'unset' if value is None else value}): the checks run on one GPU"


def main(argv: list[str] | None = None) -> int:
    pinned = pin_one_gpu()  # before torch touches CUDA
    p = argparse.ArgumentParser(prog="python -m trainer.gpu_selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when present, else the CUDA checks SKIP; cpu: the same code at a tiny size")
    p.add_argument("--only", default=None, help=f"comma list of checks to run (of {', '.join(CHECKS)})")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--bound-s", type=float, default=None,
                   help="every check's time bound in seconds (default: per check, 4x on the CPU)")
    args = p.parse_args(argv)
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"selfcheck: unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    import torch

    device = resolve_device(args.device)
    tiny = device is not None and device.type == "cpu"
    where = ("CPU, tiny sizes" if tiny else f"{torch.cuda.get_device_name(device)}" if device is not None else "no CUDA")
    print(f"selfcheck: torch {torch.__version__} (CUDA {torch.version.cuda}), {where}"
          + (f"; {pinned}" if pinned else ""), flush=True)
    results = []
    for name in names:
        if device is None and name != "weight_iterator":
            result = Result(name, "SKIP", "(torch.cuda.is_available() is false; --device cpu runs it at a tiny size)")
        elif device is None:
            result = Result(name, "SKIP", "(needs CUDA for vLLM's packed streams; --device cpu stands in no-op ones)")
        else:
            bound = args.bound_s or BUDGET_S[name] * (4 if tiny else 1)  # a busy CPU box is slower
            result = run_check(name, device, tiny, bound)
        results.append(result)
        print(result.line(), flush=True)
    failed = [r.name for r in results if r.verdict == "FAIL"]
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "SKIP")}
    print(f"selfcheck: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
          + (f" (FAIL: {', '.join(failed)})" if failed else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
