"""The trainer's side of the self-check: master weights, two GRPO steps of the project's trainer class, the colocate
memory budget (docs/gpu-host.md "GPU self-check")."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

from trainer.core import grpo_args
from trainer.gpu_selfcheck.base import GB, Result, autocast, param_group, qwen3_config

CARDS_GB = (24, 48, 80, 141)
LR = 1e-5  # the GPU default learning rate (contract.config.GPU_DEFAULT_LR)
ADAM_STEPS = 3
# What the echo prompt takes with its tool schema rendered is about 200 tokens; 512 leaves room for longer envs.
PROMPT_TOKENS = 512
# fp32 master weights must move nearly every element at lr 1e-5; bf16 ones are reported, not judged.
MIN_FP32_CHANGED = 0.9


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
                # a busy CI box: same code, shorter episodes (the untrained model writes every token it may: 96
                # cost this check ~44 CPU-s, 32 ~30)
                argv += ["--max-completion-length", "32"]
            # cpu: the CPU profile; cuda: the GPU settings (bf16 autocast where supported), transformers generation.
            cfg = RunConfig.load(argv).resolved(CpuMode() if device.type == "cpu" else ColocateMode())
            training_args = grpo_args.grpo_config(cfg, use_vllm=False)
            model, tokenizer = load_model_and_tokenizer(cfg)
            load_dtype = str(model.dtype).removeprefix("torch.")
            specs = {"echo": registry.get("echo")}
            trainer_cls = make_trainer_class()
            metrics = MetricsCallback(cfg.run_dir, STATS, mode=cfg.placement,
                                      print_fn=lambda line: print(line, file=sys.stderr),
                                      trackers=Trackers([], RunInfo(cfg.run_dir, "selfcheck", cfg.output_dir)))
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
