"""Score a model's first turn against the expert's first tool call, on prompts rendered exactly as GRPO renders them.

    python -m trainer.first_turn --model /outputs/echo/checkpoint-30 [--env echo] [--rows 60] [--seed 1000003]

The learning check of the CPU profile: greedy decoding is deterministic, and the first call is what the echo
reward is decided by, so "exact first calls" before and after training says whether the RL loop learned,
without the noise of a sampled training reward. Needs no env server: it only reads the prompt and the
expert's call (`EnvSpec.demo_calls`), so it works for the built-in envs.
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
    from trainer.envs_binding import tool_method_names

    return [getattr(tool_class, name) for name in tool_method_names(tool_class)]


def first_calls(model, tokenizer, prompts: list[tuple[list[dict], list]], template_kwargs: dict[str, Any],
                greedy: bool, max_new_tokens: int = 48) -> list[dict | None]:
    """The first tool call (`{"name", "arguments"}`) of each (prompt, tools)'s first turn, or None when it makes
    none. Prompts are rendered with TRL's training template, the tools and template kwargs, as GRPO renders them."""
    import torch
    from trl.chat_template_utils import add_response_schema, get_training_chat_template, parse_response

    template = get_training_chat_template(tokenizer)
    had_schema = getattr(tokenizer, "response_template", None) is not None
    add_response_schema(tokenizer)
    calls: list[dict | None] = []
    try:
        for prompt, tools in prompts:
            ids = tokenizer.apply_chat_template(prompt, tools=tools, chat_template=template, add_generation_prompt=True,
                                                tokenize=True, return_dict=True, **template_kwargs)["input_ids"]
            sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0,
                                                             "top_p": 1.0}  # TRL's sampling defaults
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id, **sampling)
            parsed = parse_response(tokenizer, out[0][len(ids):].tolist(), prefix=ids, tools=tools)
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
             template_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
    """Greedy exact-first-call rate of the model in `model_dir` on `rows` held-out rows of a built-in env."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import registry

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar per evaluation
    spec = registry.get(env)
    data = spec.make_dataset(rows, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tools = tool_functions(spec.tool_class)
    calls = first_calls(model, tokenizer, [(row["prompt"], tools) for row in data],
                        template_kwargs if template_kwargs is not None else {"enable_thinking": False}, greedy=True)
    expected = [dict(zip(("name", "arguments"), spec.demo_calls(row)[0])) for row in data]
    return score(calls, expected)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.first_turn", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder (the tiny model, or a run's checkpoint-N)")
    p.add_argument("--env", default="echo", help="built-in env whose held-out prompts to use (default echo)")
    p.add_argument("--rows", type=int, default=60)
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED)
    args = p.parse_args(argv)
    print(json.dumps(evaluate(args.model, args.env, args.rows, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
