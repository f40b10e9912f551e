"""Score a model's first turn against the expert's first tool call, on prompts rendered exactly as GRPO renders them.

    python -m trainer.after.first_turn --model /outputs/echo/checkpoint-30 [--env echo] [--rows 60] [--seed 1000003]
    python -m trainer.after.first_turn --model /models/tiny-qwen3 --server http://vllm:8000   # what vLLM serves now

The learning check of the CPU profile: greedy decoding is deterministic, and the first call is what the echo
reward is decided by, so "exact first calls" before and after training says whether the RL loop learned,
without the noise of a sampled training reward. Needs no env server: it only reads the prompt and the
expert's call (`EnvSpec.demo_calls`), so it works for the built-in envs. With `--server`, a vLLM server generates
(greedy, from the same token ids) and `--model` gives only the tokenizer: the check of what the server serves after
weight pushes (`make rehearse`'s learning check on the vLLM CPU twin).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Rows for evaluation come from this seed; training draws rows from SEED (+ env index), never from here. Echo has
# six prompts in all (one per word), so its held-out rows are new draws of the same six prompts, not new words.
HELD_OUT_SEED = 1_000_003


def tool_functions(tool_class: type) -> list:
    from trainer.rollouts.envs_binding import tool_method_names

    return [getattr(tool_class, name) for name in tool_method_names(tool_class)]


def first_calls(model, tokenizer, prompts: list[tuple[list[dict], list]], template_kwargs: dict[str, Any],
                greedy: bool, max_new_tokens: int = 48) -> list[dict | None]:
    """The first tool call (`{"name", "arguments"}`) of each (prompt, tools)'s first turn, or None when it makes
    none. Prompts are rendered with TRL's training template, the tools and template kwargs, as GRPO renders them."""
    import torch

    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0,
                                                     "top_p": 1.0}  # TRL's sampling defaults

    def generate(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        return out[0][len(ids):].tolist()

    return parsed_first_calls(once_per_prompt(generate) if greedy else generate, tokenizer, prompts, template_kwargs)


def once_per_prompt(generate):
    """`generate` run once per distinct prompt: greedy decoding gives one answer to one prompt, and held-out rows
    repeat their prompts (echo's 60 are its 6 words, catch's and wordle's one prompt each), so a repeat costs nothing
    and scores the same. Only for greedy generation: sampled answers differ on each call."""
    answers: dict[tuple[int, ...], list[int]] = {}

    def once(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in answers:
            answers[key] = generate(ids)
        return list(answers[key])

    return once


def served_generate(server: str, max_new_tokens: int = 48, timeout_s: float = 120):
    """generate(ids) -> completion ids, greedy, by the vLLM server at `server` (its /v1/completions from token ids)."""
    import requests

    server = server.rstrip("/")
    model = requests.get(f"{server}/v1/models", timeout=timeout_s).json()["data"][0]["id"]

    def generate(ids: list[int]) -> list[int]:
        r = requests.post(f"{server}/v1/completions", timeout=timeout_s, json={
            "model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0, "return_token_ids": True,
            # no penalty a model's generation_config may add (vLLM fills it into fields a request leaves out)
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    return generate


def parsed_first_calls(generate, tokenizer, prompts: list[tuple[list[dict], list]],
                       template_kwargs: dict[str, Any]) -> list[dict | None]:
    """first_calls with `generate(prompt ids) -> completion ids` doing the generation."""
    from trl.chat_template_utils import add_response_schema, get_training_chat_template, parse_response

    template = get_training_chat_template(tokenizer)
    had_schema = getattr(tokenizer, "response_template", None) is not None
    add_response_schema(tokenizer)
    calls: list[dict | None] = []
    try:
        for prompt, tools in prompts:
            ids = tokenizer.apply_chat_template(prompt, tools=tools, chat_template=template, add_generation_prompt=True,
                                                tokenize=True, return_dict=True, **template_kwargs)["input_ids"]
            parsed = parse_response(tokenizer, generate(list(ids)), prefix=ids, tools=tools)
            tool_calls = parsed.get("tool_calls") or []
            calls.append(dict(tool_calls[0]["function"]) if tool_calls else None)
    finally:
        if not had_schema:
            del tokenizer.response_template
    return calls


def score(calls: list[dict | None], expected: list[dict | None]) -> dict[str, float]:
    """Share of prompts with a tool call, and with exactly the expert's first call (name and arguments)."""
    n = len(expected)
    made = sum(call is not None for call in calls)
    exact = sum(call is not None and want is not None and call.get("name") == want["name"]
                and call.get("arguments") == want["arguments"] for call, want in zip(calls, expected, strict=True))
    return {"prompts": n, "tool_call_rate": made / n, "exact_rate": exact / n}


def evaluate(model_dir: str, env: str = "echo", rows: int = 60, seed: int = HELD_OUT_SEED,
             template_kwargs: dict[str, Any] | None = None, server: str | None = None) -> dict[str, float]:
    """Greedy exact-first-call rate of the model in `model_dir` on `rows` held-out rows of a built-in env; with
    `server`, of the model that vLLM server serves (`model_dir` gives the tokenizer)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import registry

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar per evaluation
    spec = registry.get(env)
    data = spec.make_dataset(rows, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = tool_functions(spec.tool_class)
    prompts = [(row["prompt"], tools) for row in data]
    kwargs = template_kwargs if template_kwargs is not None else {"enable_thinking": False}
    if server:
        calls = parsed_first_calls(once_per_prompt(served_generate(server)), tokenizer, prompts, kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        calls = first_calls(model, tokenizer, prompts, kwargs, greedy=True)
    expected = [dict(zip(("name", "arguments"), spec.demo_calls(row)[0])) for row in data]
    return score(calls, expected)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.after.first_turn", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder (the tiny model, or a run's checkpoint-N)")
    p.add_argument("--env", default="echo", help="built-in env whose held-out prompts to use (default echo)")
    p.add_argument("--rows", type=int, default=60)
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED)
    p.add_argument("--server", default=None, help="a vLLM server's URL: score what it serves (--model: the tokenizer)")
    args = p.parse_args(argv)
    print(json.dumps(evaluate(args.model, args.env, args.rows, args.seed, server=args.server)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
