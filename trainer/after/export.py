"""Export a run's checkpoint as a standalone Hugging Face model folder, optionally pushed to the Hub.

    python -m trainer.export --outputs /outputs [--run R] [--checkpoint checkpoint-N|N|best] [--out DIR | --out-dir D]
                             [--push org/name] [--adapter]

The folder holds the weights (safetensors), config, generation config, tokenizer with its chat template and a model
card (README.md: base model, envs, steps, reward curve, settings, eval table) and nothing of the trainer's own
(optimizer, scheduler, RNG, trainer state). It loads in transformers and in `vllm serve`. A LoRA run's checkpoints hold the adapter only: by default the export
merges it into the base model (a standalone folder like a full fine-tune's); `--adapter` (EXPORT_ADAPTER=1) writes the
adapter alone (peft's folder: `vllm serve BASE --enable-lora --lora-modules NAME=FOLDER`).
Default: the run written last, its last complete checkpoint, written to <run>/export (--out-dir D: D/<run>).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from contract import eval_report
from trainer.run import run_info
from trainer.core.metrics import read_metrics
from trainer.after.report import ReportError, find_run
from trainer.run.checkpoints import CheckpointError, pick
from trainer.modeling.lora import is_adapter

SECRET = Path("/run/secrets/hf_token")
CARD_MARKER = "<!-- written by trainer.export -->"  # only a folder carrying it is replaced by a new export
# Checkpoint files that are the model itself; everything else there (optimizer.pt, scheduler.pt, rng_state*.pth,
# trainer_state.json, training_args.bin, DeepSpeed/FSDP shards) is the trainer's and stays behind.
WEIGHT_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
# The settings a reader of the card needs to judge or repeat the run (RunConfig fields, as in run.json).
CARD_SETTINGS = ("max_steps", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "steps_per_generation", "max_completion_length", "max_tool_calling_iterations", "temperature",
                 "unfinished_penalty", "enable_thinking", "dataset_size", "seed", "trainer_processes",
                 "trainer_sharding", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "qlora",
                 "rollouts", "max_staleness")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ExportError(RuntimeError):
    pass


def write_weights(path: Path, out: Path, dtype: str | None) -> int:
    """One safetensors file of the checkpoint into `out`: byte for byte, or with its floating tensors cast to `dtype`
    (the base model's published dtype: training keeps fp32 master weights, the export is served like the base).
    Returns the bytes of the tensors written when cast, else 0."""
    if path.suffix != ".safetensors" or dtype not in ("bfloat16", "float16"):
        shutil.copyfile(path, out / path.name)
        return 0
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    tensors = {name: t.to(target) if t.is_floating_point() else t for name, t in load_file(path).items()}
    save_file(tensors, out / path.name, metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_model(ckpt: Path, out: Path, dtype: str | None = None) -> None:
    """The model folder from the checkpoint: its safetensors (in `dtype` when given: run.json's base_dtype), else the
    weights loaded and saved as safetensors; config (use_cache on again for inference), generation config,
    tokenizer + template."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    weights = [p for pattern in WEIGHT_FILES for p in ckpt.glob(pattern)]
    unreadable = [p for p in ckpt.iterdir() if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:  # checkpoints saved before the trainer made them readable to all (trainer.train on_save)
        run = ckpt.parent.name
        raise ExportError(f"{run}/{ckpt.name}/{unreadable[0].name} is readable by the trainer's uid only (an older "
                          f"run); make it readable once: `docker run --rm -v grpo-stack_outputs:/outputs "
                          f"grpo-stack/trainer:cpu chmod -R a+r /outputs/{run}`, then export again")
    from trainer.modeling import lora

    if lora.is_adapter(ckpt):  # a LoRA run: base + adapter, merged, in the base's published dtype
        import torch

        model = lora.merged_model(ckpt)
        if dtype in ("bfloat16", "float16"):
            model = model.to(getattr(torch, dtype))
        model.save_pretrained(out)
    elif weights:
        written = sum(write_weights(path, out, dtype) for path in weights)
        index = out / "model.safetensors.index.json"
        if written and index.exists():  # its total_size counted the fp32 bytes
            meta = json.loads(index.read_text())
            meta.setdefault("metadata", {})["total_size"] = written
            index.write_text(json.dumps(meta, indent=2) + "\n")
    elif (ckpt / "pytorch_model.bin").exists():
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype if dtype in ("bfloat16", "float16") else "auto"
                                             ).save_pretrained(out)
    else:
        raise ExportError(f"{ckpt} holds no model weights (model.safetensors, pytorch_model.bin or a LoRA adapter)")
    config = AutoConfig.from_pretrained(out if lora.is_adapter(ckpt) else ckpt)
    config.use_cache = True  # training turns the KV cache off; generation wants it
    if dtype in ("bfloat16", "float16"):
        config.dtype = dtype  # the checkpoint's says float32 (the master weights)
    config.save_pretrained(out)
    if (ckpt / "generation_config.json").exists():
        GenerationConfig.from_pretrained(ckpt).save_pretrained(out)
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)  # tokenizer files and chat_template.jinja


def write_adapter(ckpt: Path, out: Path, info: dict[str, Any]) -> None:
    """The adapter alone (peft's folder) and the tokenizer; its base recorded as the Hub id it was trained from (at
    the pinned revision) when there is one, so a reader loads it on that base anywhere."""
    from transformers import AutoTokenizer

    from trainer.modeling import lora

    if not lora.is_adapter(ckpt):
        raise ExportError(f"EXPORT_ADAPTER=1: {ckpt.name} holds full weights, not an adapter (the run trained with "
                          "LORA_R=0); export without EXPORT_ADAPTER")
    for name in ADAPTER_FILES:
        shutil.copyfile(ckpt / name, out / name)
    adapter = lora.adapter_info(ckpt)
    base = info.get("base_model")
    if base and not base.startswith(("/", ".")) and base.count("/") == 1:
        adapter.update(base_model_name_or_path=base, revision=info.get("model_revision"))
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)


def training_line(settings: dict[str, Any], adapter_only: bool) -> str:
    """The card's line on what was trained: every weight, or a LoRA adapter and its settings."""
    r = settings.get("lora_r") or 0
    if not r:
        return "full fine-tuning (every weight trained)"
    alpha = settings.get("lora_alpha") or 2 * r
    what = (f"LoRA{' on a 4-bit base (QLoRA)' if settings.get('qlora') else ''}: r={r}, alpha={alpha:g}, dropout="
            f"{settings.get('lora_dropout') or 0:g}, target modules `{settings.get('lora_target_modules')}`")
    return what + ("; this folder is the adapter alone" if adapter_only else "; the adapter is merged into the base "
                   "weights in this folder")


def reward_curve(rows: list[dict[str, Any]], step: int) -> list[tuple[str, int, float, int, float]]:
    """(curve, first step, its value, last step <= `step`, its value) for the reward and each env's reward."""
    rows = [r for r in rows if r.get("step", 0) <= step]
    keys = ["reward"] + sorted({k for r in rows for k in r if k.startswith("env/") and k.endswith("/reward_mean")})
    curves = []
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            curves.append((key, *points[0], *points[-1]))
    return curves


def model_card(run_dir: Path, ckpt: Path, step: int, where: str = "PATH", adapter_only: bool = False) -> str:
    """README.md of the folder; `where`: how a reader names the model (its Hub repo, else a placeholder)."""
    from huggingface_hub import ModelCardData

    info = run_info.read(run_dir) or {}
    rows = read_metrics(run_dir)
    envs = info.get("envs") or sorted({k.split("/")[1] for r in rows for k in r
                                       if k.startswith("env/") and k.endswith("/reward_mean")})
    base = info.get("base_model")
    revision = info.get("model_revision")
    hub_base = base if base and not base.startswith(("/", ".")) and base.count("/") == 1 else None
    settings = info.get("settings") or {}
    lora_tags = ["lora", "peft"] if settings.get("lora_r") else []
    meta = ModelCardData(base_model=hub_base, library_name="peft" if adapter_only else "transformers",
                         pipeline_tag="text-generation", tags=["grpo", "trl", "tool-use", "agent", *lora_tags, *envs])
    base_line = (f"`{base}`" + (f" at revision `{revision}`" if revision and hub_base else "")) if base else \
        "not recorded (the run predates run.json)"
    lines = [f"---\n{meta.to_yaml()}\n---", CARD_MARKER, "", f"# {run_dir.name}", "",
             f"A tool-using agent trained with GRPO (TRL) against OpenEnv environments, exported from "
             f"`{run_dir.name}/{ckpt.name}`.", "",
             f"- **Base model**: {base_line}",
             f"- **Environments**: {', '.join(f'`{e}`' for e in envs) or 'not recorded'}",
             f"- **Steps**: {step} optimizer steps" + (f" (TRAIN_MODE `{info['mode']}`)" if info.get("mode") else ""),
             f"- **Training**: {training_line(settings, adapter_only)}",
             ""]
    curves = reward_curve(rows, step)
    lines += ["## Reward during training", ""]
    if curves:
        lines += ["| curve | start | end |", "|---|---|---|"]
        lines += [f"| {key} | {v0:.3f} (step {s0}) | {v1:.3f} (step {s1}) |" for key, s0, v0, s1, v1 in curves]
        lines += ["", "`reward`: mean episode reward of each step's batch; `env/<name>/reward_mean`: that env's part."]
    else:
        lines.append("No logged steps in metrics.jsonl.")
    lines += ["", "## Training settings", ""]
    if settings:
        lines += ["| setting | value |", "|---|---|", f"| learning_rate | {info.get('learning_rate')} |"]
        lines += [f"| {key} | {settings[key]} |" for key in CARD_SETTINGS if settings.get(key) is not None]
    else:
        lines.append("Not recorded (the run predates run.json).")
    evaluation = eval_report.read(run_dir)
    if evaluation:
        lines += ["", "## Evaluation (held-out episodes, base vs trained)", ""]
        if evaluation.get("checkpoint") != ckpt.name:
            lines += [f"Measured on {evaluation.get('checkpoint')} (step {evaluation.get('step')}), not on the "
                      f"exported {ckpt.name}.", ""]
        lines.append(eval_report.markdown_table(evaluation))
    if adapter_only:
        rank = max(settings.get("lora_r") or 1, 1)
        from contract.lora_rules import served_max_lora_rank

        base_name = hub_base or base or "BASE"
        lines += ["", "## Use", "", "The adapter of a LoRA run, on its base model `" + base_name + "`.", "", "```python",
                  "from peft import AutoPeftModelForCausalLM",
                  f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")  # loads the base, then the adapter',
                  "```", "", "```bash",
                  f"vllm serve {base_name} --enable-lora --max-lora-rank {served_max_lora_rank(rank)} "
                  f"--lora-modules {run_dir.name}={where}", "```", ""]
        return "\n".join(lines)
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f'model = AutoModelForCausalLM.from_pretrained("{where}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{where}")  # with the chat template it was trained with',
              "```", "", "```bash", f"vllm serve {where}", "```", ""]
    return "\n".join(lines)


def export(run_dir: Path, ckpt: Path, step: int, out: Path, repo_id: str | None = None,
           adapter_only: bool = False) -> Path:
    """Write the folder next to `out` and swap it in whole, so a failed export leaves the previous one intact."""
    if out.exists():
        card = out / "README.md"
        ours = card.is_file() and CARD_MARKER in card.read_text(errors="replace")
        if not ours and (out.is_file() or any(out.iterdir())):
            raise ExportError(f"{out} exists and is not an earlier export; choose another folder (--out)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    try:
        info = run_info.read(run_dir) or {}
        if adapter_only:
            write_adapter(ckpt, tmp, info)
        else:
            write_model(ckpt, tmp, info.get("base_dtype"))
        (tmp / "README.md").write_text(model_card(run_dir, ckpt, step, repo_id or "PATH", adapter_only))
        for path in tmp.iterdir():  # readable by whoever serves it (vLLM's container runs as another uid)
            path.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_token(path: Path = SECRET) -> str:
    try:
        token = path.read_text().strip() if path.exists() else ""
    except PermissionError:
        raise ExportError(f"the HF token file is not readable here ({path}): `chmod 644` the file HF_TOKEN_FILE "
                          "names and `chmod 700` its directory") from None
    if not token:
        raise ExportError("no Hugging Face token to push with: put a token with write access in the file "
                          "HF_TOKEN_FILE names in .env (default .secrets/hf_token), then run again")
    return token


def push(folder: Path, repo_id: str, token: str) -> str:
    """create_repo (private when new) + upload_folder, huggingface_hub's own calls; returns the repo's URL."""
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ExportError(f"PUSH={repo_id!r} is not a Hub repo id ({exc}); use org/name") from None
    import httpx

    api = huggingface_hub.HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=True, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message=f"Export {folder.name} (trainer.export)")
    except (httpx.HTTPError, OSError) as exc:  # HfHubHTTPError is both; no network is httpx's
        why = " ".join(str(exc).split())[:300]
        raise ExportError(f"push to {repo_id} failed: {why} (the folder is written: {folder}); check the token's "
                          "write access to that org and this host's network, then run again") from None
    return str(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make export", description=__doc__.splitlines()[0])
    p.add_argument("--outputs", default="/outputs", help="where runs live (default /outputs)")
    p.add_argument("--run", help="run name under --outputs (default: the run written last)")
    p.add_argument("--checkpoint", help="checkpoint-N, N, or best (checkpoint-best: the best by the evaluation during "
                   "training, EVAL_EVERY; default: the last complete one)")
    p.add_argument("--out", help="the folder to write (default: <out-dir>/<run>, else <run>/export)")
    p.add_argument("--out-dir", help="write <out-dir>/<run>")
    p.add_argument("--push", metavar="ORG/NAME", help="also upload the folder to this Hub repo (private when new)")
    p.add_argument("--adapter", action="store_true", help="a LoRA run: write the adapter alone instead of base + "
                   "adapter merged (EXPORT_ADAPTER=1)")
    p.add_argument("--token-file", default=str(SECRET), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        token = read_token(Path(args.token_file)) if args.push else None  # before the work, not after it
        run_dir = find_run(Path(args.outputs), args.run)
        ckpt, step = pick(run_dir, args.checkpoint)
        out = Path(args.out) if args.out else Path(args.out_dir) / run_dir.name if args.out_dir else run_dir / "export"
        export(run_dir, ckpt, step, out, args.push, args.adapter)
        what = "adapter" if args.adapter else "merged base + adapter" if is_adapter(ckpt) else "model"
        print(f"[export] {run_dir.name}/{ckpt.name} (step {step}) -> {out} ({what})")
        if args.push:
            print(f"[export] pushed to {push(out, args.push, token)}")
    except (ExportError, ReportError, CheckpointError) as exc:
        print(f"[export] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
