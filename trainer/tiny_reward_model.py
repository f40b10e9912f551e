"""A tiny real reward model: a Qwen3ForSequenceClassification with one label (what reward models are), for
JUDGE_METHOD=reward_model on the vLLM CPU twin (docs/judge.md "A reward model").

    python -m trainer.tiny_reward_model --base /models/tiny-qwen3 --out /models/tiny-reward-model
                                    (model-init runs it when JUDGE_MODEL=/models/tiny-reward-model)

The trunk is the tiny policy's (trainer.tiny_model: it already reads echo episodes and tool calls); the one-label
head (`score`, no bias, as transformers makes it) is fitted in seconds on the trunk's last-token states, by logistic
regression on echo episodes rendered exactly as trainer.judge sends them to `/classify` (the task and the transcript
as a chat, through the chat template): target 1 for the right first call, 1/3 for a call with another word, 0 for no
call (trainer.tiny_judge's episodes and grades). So its score (sigmoid of the logit) is higher for episodes that
called the tool, a meaningful reward, not a random head. Idempotent: a marker written last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from contract.config.judge import TINY_REWARD_MODEL  # noqa: E402 - JUDGE_MODEL naming it: model-init builds it
from contract.config.model import CPU_DEFAULT_MODEL  # noqa: E402 - the tiny policy, the trunk's source

MARKER = "tiny_reward_model.json"
RECIPE_VERSION = 1
TARGETS = {"right": 1.0, "wrong": 1 / 3, "none": 0.0}  # tiny_judge's grades 9 / 3 / 0, over 9


def log(msg: str) -> None:
    print(f"[tiny-reward-model] {msg}", flush=True)


def is_complete(out: Path) -> bool:
    try:
        meta = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("recipe_version") == RECIPE_VERSION and (out / "model.safetensors").exists()


def episodes(n: int, seed: int) -> list[tuple[list[dict], list[dict], str]]:
    """(prompt, completion, kind) for `n` echo episodes in TRL's message format, the kinds in equal shares."""
    from envs.echo.task import make_dataset
    from trainer.tiny_judge import KINDS, episode

    rng = random.Random(seed)
    out = []
    for i, row in enumerate(make_dataset(n, seed)):
        kind = KINDS[i % len(KINDS)]
        out.append((row["prompt"], episode(kind, row["target"], rng), kind))
    return out


def request_messages(prompt: list[dict], completion: list[dict]) -> list[dict]:
    """The messages trainer.judge sends to `/classify` for this episode (methods.reward_model_request)."""
    from trainer.judge import methods, transcript

    setup = type("Setup", (), {"model": "tiny-reward-model"})()
    return methods.reward_model_request(setup, transcript.task_of(prompt), transcript.render(completion))["messages"]


def examples(n: int, seed: int) -> list[tuple[list[dict], str]]:
    """(the /classify request's messages, kind) per episode."""
    return [(request_messages(prompt, completion), kind) for prompt, completion, kind in episodes(n, seed)]


def rendered_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template over the messages, no generation prompt: what vLLM's /classify renders for a chat request
    (add_generation_prompt defaults to false there)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def last_states(model, tokenizer, items) -> "torch.Tensor":  # noqa: F821 - torch imported lazily
    """The trunk's final (normed) hidden state at each episode's last token: what the head scores (vLLM pools LAST)."""
    import torch

    with torch.no_grad():
        return torch.stack([model.model(input_ids=torch.tensor([rendered_ids(tokenizer, m)])).last_hidden_state[0, -1]
                            for m, _ in items])


def scores(model, tokenizer, items) -> list[float]:
    """sigmoid(logit) per episode through transformers' own forward (what vLLM's /classify should agree with)."""
    import torch

    with torch.no_grad():
        return [float(torch.sigmoid(model(input_ids=torch.tensor([rendered_ids(tokenizer, m)])).logits[0, 0]))
                for m, _ in items]


def by_kind(values: list[float], items) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for v, (_, kind) in zip(values, items):
        out.setdefault(kind, []).append(v)
    return {k: round(sum(v) / len(v), 3) for k, v in out.items()}


def fit_head(states, targets, steps: int, lr: float) -> "torch.Tensor":  # noqa: F821
    """Logistic regression without a bias (transformers' Qwen3 score head has none) on fixed features: seconds."""
    import torch

    w = torch.zeros(states.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(states @ w, targets)
        loss.backward()
        opt.step()
    return w.detach()


def build(base: Path, out: Path, n: int, seed: int, steps: int, lr: float) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen3ForSequenceClassification
    from transformers.utils import logging as hf_logging

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a few hundred forwards of a 0.5M-parameter model: one core is plenty
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(base)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialised": it is, next
    model = Qwen3ForSequenceClassification.from_pretrained(base, num_labels=1).eval()
    hf_logging.set_verbosity(verbosity)
    train, held_out = examples(n, seed), examples(96, seed + 1_000_003)
    states = last_states(model, tokenizer, train)
    targets = torch.tensor([TARGETS[kind] for _, kind in train])
    weight = fit_head(states, targets, steps, lr)
    model.score.weight.data.copy_(weight[None, :])
    model.config.problem_type = None  # a reward model's single logit; vLLM then scores sigmoid(logit)
    held = by_kind(torch.sigmoid(last_states(model, tokenizer, held_out) @ weight).tolist(), held_out)
    fit_s = time.monotonic() - t0
    log(f"head fitted on {len(train)} episodes in {fit_s:.1f}s; held-out mean score by kind: {held}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"recipe_version": RECIPE_VERSION, "base": str(base), "examples": n, "targets": TARGETS,
            "held_out_mean_score": held, "fit_s": round(fit_s, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (tmp / MARKER).write_text(json.dumps(meta, indent=2))  # written last: marks the model complete
    for p in [tmp, *tmp.rglob("*")]:  # the twin (uid 10001) reads it
        p.chmod(0o755 if p.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta


def ensure(base: Path, out: Path, force: bool = False, **options) -> int:
    """Build the reward model at `out` unless a complete one is there; 0, or 1 with one line saying why not."""
    if is_complete(out) and not force:
        log(f"{out} is already complete; nothing to do (--force rebuilds)")
        return 0
    if not (base / "config.json").is_file():
        log(f"no base model at {base}: make the tiny policy first (`python -m trainer.tiny_model --out {base}`)")
        return 1
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        build(base, out, options.get("examples", 192), options.get("seed", 4321), options.get("steps", 300),
              options.get("lr", 0.05))
    except OSError as exc:
        log(f"cannot make the tiny reward model at {out}: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.tiny_reward_model", description=__doc__.splitlines()[0])
    p.add_argument("--base", default=CPU_DEFAULT_MODEL, help="the tiny policy whose trunk it reuses")
    p.add_argument("--out", default=TINY_REWARD_MODEL, help="model folder")
    p.add_argument("--examples", type=int, default=192)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--force", action="store_true", help="rebuild even if a complete one is there")
    args = p.parse_args(argv)
    return ensure(Path(args.base), Path(args.out), args.force, examples=args.examples, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
