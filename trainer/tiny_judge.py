"""The CPU profile's tiny judge: a Qwen3 as small as trainer.tiny_model's policy, taught by a short SFT to grade echo
episodes through the stack's own rubric, so a CPU run can learn from a judge alone (docs/judge.md "Learning from the
judge alone on CPU").

    python -m trainer.tiny_judge --out /models/tiny-judge        (model-init runs it when JUDGE_MODEL=/models/tiny-judge)

Idempotent like trainer.tiny_model (a marker written last). The policy's recipe is untouched: this is another folder.
 1. episodes: echo's dataset rows, each played three ways in TRL's completion format: the right first call (grade 9),
    a call with another word (3: "partly done"), no call (0); variants the policy also writes (a capital, a trailing
    full stop, a second call, no closing answer). Only the first call decides, as echo's reward does;
 2. each rendered exactly as the trainer renders it for the judge (trainer.judge.transcript, methods.rubric_request
    with the rubric file JUDGE_RUBRIC names, default prompts/judge/rubric.md) and through the chat template with the
    request's chat_template_kwargs, as vLLM renders the call. The env's reward the rubric shows is drawn at random,
    apart from the grade: the judge learns to grade the transcript, not to copy the env's number (a run with
    ENV_REWARD_WEIGHT=0 then learns from the transcript's grade, not from the env's reward in disguise);
 3. a tokenizer and model as trainer.tiny_model makes them (a window of JUDGE_WINDOW tokens: the judge service's
    default --max-model-len), and a supervised pass with the loss on the answer digit alone.
The answer's ids follow the prompt's ids (never re-tokenized together): what vLLM's constrained choice generates.
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

from contract.config.judge import TINY_JUDGE as TINY_JUDGE_DIR  # noqa: E402 - JUDGE_MODEL naming it: model-init builds it
MARKER = "tiny_judge.json"
RECIPE_VERSION = 1
JUDGE_WINDOW = 8192  # compose.yaml's JUDGE_MAX_MODEL_LEN default: the twin serves it with no extra .env line
GRADES = {"right": "9", "wrong": "3", "none": "0"}
KINDS = tuple(GRADES)
ENV_REWARDS = (None, 0.0, 0.2, 1.0)  # what the rubric shows as the env's reward: drawn apart from the grade


def log(msg: str) -> None:
    print(f"[tiny-judge] {msg}", flush=True)


def is_complete(out: Path) -> bool:
    try:
        meta = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("recipe_version") == RECIPE_VERSION and all(
        (out / n).exists() for n in ("config.json", "model.safetensors", "tokenizer.json"))


def _call(message: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "echo_message", "arguments": {"message": message}}}]}


def _result(message: str) -> dict:
    return {"role": "tool", "name": "echo_message", "content": message}


def episode(kind: str, target: str, rng: random.Random) -> list[dict]:
    """One echo episode's completion (TRL's messages) of `kind`: right, wrong (another word first), none (no call)."""
    from envs.echo.task import WORDS

    done = [] if rng.random() < 0.15 else [{"role": "assistant", "content": rng.choice(["Done.", "Done", target])}]
    if kind == "none":
        return [{"role": "assistant", "content": rng.choice(["Done.", "Done", target, f"{target}.", "I cannot."])}]
    word = target if kind == "right" else rng.choice([w for w in WORDS if w != target])
    said = rng.choice([word, word, word, word.capitalize(), f"{word}."])
    turns = [_call(said), _result(said)]
    if rng.random() < 0.2:  # a second call: only the first one counts
        again = rng.choice(WORDS)
        turns += [_call(again), _result(again)]
    return turns + done


def rendered(setup, prompt: list[dict], completion: list[dict], env_reward: float | None) -> list[dict]:
    """The judge call's messages exactly as trainer.judge builds them for this episode."""
    from trainer.judge import methods, transcript

    return methods.rubric_request(setup, transcript.task_of(prompt), transcript.render(completion),
                                  env_reward)["messages"]


def examples(setup, n: int, seed: int) -> list[tuple[list[dict], str, str]]:
    """(judge messages, grade digit, kind) for `n` echo episodes, the kinds in equal shares."""
    from envs.echo.task import make_dataset

    rng = random.Random(seed)
    out = []
    for i, row in enumerate(make_dataset(n, seed)):
        kind = KINDS[i % len(KINDS)]
        completion = episode(kind, row["target"], rng)
        out.append((rendered(setup, row["prompt"], completion, rng.choice(ENV_REWARDS)), GRADES[kind], kind))
    return out


def encode(tokenizer, items, template_kwargs: dict) -> list[tuple[list[int], list[int]]]:
    """Prompt ids (chat template + generation prompt, as vLLM renders the call), then the digit and <|im_end|>: the
    loss on those two alone."""
    data = []
    for messages, digit, _ in items:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(digit, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        data.append((ids + answer, [0] * len(ids) + [1] * len(answer)))
    return data


def accuracy(model, tokenizer, items, template_kwargs: dict) -> dict[str, float]:
    """Per kind, the share of episodes whose likeliest digit (what a constrained choice at temperature 0 answers) is
    the grade."""
    import torch

    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    hits: dict[str, list[int]] = {k: [] for k in KINDS}
    with torch.no_grad():
        for messages, digit, kind in items:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   **template_kwargs)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1, digit_ids]
            hits[kind].append(int(str(int(logits.argmax())) == digit))
    return {k: round(sum(v) / len(v), 3) for k, v in hits.items() if v}


def make_model(tokenizer, seed: int, layers: int):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=JUDGE_WINDOW,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def judge_setup(rubric_file: str):
    from trainer.judge.setup import JudgeSetup, rubric_path

    path = rubric_path(rubric_file)
    if not path.is_file():
        raise FileNotFoundError(f"the rubric {rubric_file} is not here ({path}): mount prompts/ (compose: "
                                "./prompts:/prompts:ro) or set JUDGE_RUBRIC to an existing file")
    return JudgeSetup(base_url="http://judge:8000/v1", method="rubric", score="choice", template=path.read_text(),
                      judged_envs=frozenset({"echo"}), concurrency=1, timeout_s=1.0, down_after_s=1.0, max_tokens=256,
                      cache_size=0, num_generations=1, model="tiny-judge")


def build(out: Path, rubric_file: str, n: int, epochs: int, lr: float, seed: int, layers: int,
          vocab_size: int) -> dict:
    import torch

    from trainer import tiny_model

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.monotonic()
    setup = judge_setup(rubric_file)
    train_items = examples(setup, n, seed)
    held_out = examples(setup, 96, seed + 1_000_003)
    kwargs = {"enable_thinking": False}  # trainer.judge.methods' chat_template_kwargs
    probe = tiny_model.make_tokenizer(["hello"], 300)
    corpus = [probe.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **kwargs) + d
              for m, d, _ in train_items]
    tokenizer = tiny_model.make_tokenizer(corpus, vocab_size)
    tokenizer.model_max_length = JUDGE_WINDOW
    data = encode(tokenizer, train_items, kwargs)
    lengths = [len(ids) for ids, _ in data]
    log(f"{len(data)} rendered judge calls (rubric {rubric_file}); {len(tokenizer)} tokens; prompts "
        f"{min(lengths)}-{max(lengths)} tokens")
    model = make_model(tokenizer, seed, layers)
    t1 = time.monotonic()
    losses = tiny_model.warm_start(model, data, tokenizer.pad_token_id, epochs, lr, batch_size=16, seed=seed)
    train_s = time.monotonic() - t1
    acc = accuracy(model, tokenizer, held_out, kwargs)
    log(f"held-out grades right (likeliest digit = grade): {acc}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"recipe_version": RECIPE_VERSION, "rubric": rubric_file, "examples": n, "epochs": epochs,
            "layers": layers, "grades": GRADES, "final_loss": losses[-1], "held_out_accuracy": acc,
            "warm_start_s": round(train_s, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (tmp / MARKER).write_text(json.dumps(meta, indent=2))  # written last: marks the model complete
    for p in [tmp, *tmp.rglob("*")]:  # the judge's twin (uid 10001) reads it
        p.chmod(0o755 if p.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"wrote {out} in {time.monotonic() - t0:.0f}s (SFT {train_s:.0f}s)")
    return meta


def ensure(out: Path, rubric_file: str | None = None, force: bool = False, **options) -> int:
    """Build the judge at `out` unless a complete one is there; 0, or 1 with one line saying why not."""
    from contract.config.judge import DEFAULT_RUBRIC

    if is_complete(out) and not force:
        log(f"{out} is already complete; nothing to do (--force rebuilds)")
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        build(out, rubric_file or DEFAULT_RUBRIC, options.get("examples", 240), options.get("epochs", 6),
              options.get("lr", 3e-3), options.get("seed", 4321), options.get("layers", 2),
              options.get("vocab_size", 1024))
    except (OSError, FileNotFoundError) as exc:
        log(f"cannot make the tiny judge at {out}: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.tiny_judge", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=TINY_JUDGE_DIR, help=f"model folder (default {TINY_JUDGE_DIR})")
    p.add_argument("--rubric", default=None, help="the rubric file (default: JUDGE_RUBRIC, else prompts/judge/rubric.md)")
    p.add_argument("--examples", type=int, default=240)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--force", action="store_true", help="rebuild even if a complete judge is there")
    args = p.parse_args(argv)
    rubric_file = args.rubric or os.environ.get("JUDGE_RUBRIC") or None
    return ensure(Path(args.out), rubric_file, args.force, examples=args.examples, epochs=args.epochs, lr=args.lr,
                  layers=args.layers, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
