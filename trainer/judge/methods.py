"""The three ways to judge (JUDGE_METHOD): each a request to build and a reply to read. A reply that says no score
(a refusal, a cut reply, text outside the constraint, a malformed body) raises JudgeFailure; it is never read as 0.

  rubric        /v1/chat/completions; the reply constrained by vLLM's structured outputs to one digit
                (`structured_outputs: {"choice": ["0", ..., "9"]}`, vLLM 0.31's OpenAI server), score digit / 9;
                JUDGE_SCORE=probabilities also asks the first token's top log-probabilities and scores the expected
                digit over the digits among them (renormalised), the rationale listing the likeliest
  ranking       one call per GRPO group: the reply constrained (`structured_outputs: {"regex": ...}`) to a JSON list
                of one digit per episode, in order; each episode's score digit / 9 (relative: the group's baseline
                takes the rest)
  reward_model  vLLM's pooling runner (`POST /classify` with chat messages, `use_activation: false`): a sequence
                classifier's raw logits, mapped here: one label (a reward model) sigmoid(logit), several the last
                class's softmax probability. Raw logits because vLLM's own activation follows the model's config
                (`problem_type: regression`, which transformers' Trainer writes for one float label, is the identity:
                scores outside [0, 1]); the logit itself is the verdict in the trace
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from trainer.judge import rubric
from trainer.judge.client import JudgeFailure

TOP_LOGPROBS = 20
MAX_LOGIT = 1e4  # a trained head's logits are tens at most; an uninitialised one's ran to 1e35 here


@dataclass(frozen=True)
class Verdict:
    score: float  # in [0, 1]
    verdict: str  # what the judge answered (a digit, the group's list, the class probability)
    rationale: str | None = None
    tokens: int = 0


def _chat(setup, prompt: str, constraint: dict[str, Any], max_tokens: int, logprobs: bool = False) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": setup.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0.0, "structured_outputs": constraint,
        "chat_template_kwargs": {"enable_thinking": False},  # a thinking judge spends its budget before the answer
    }
    if logprobs:
        payload.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
    return payload


# ---------------------------------------------------------------------------------------------------------- rubric
def rubric_request(setup, task: str, transcript: str, env_reward: float | None) -> dict[str, Any]:
    prompt = rubric.fill(setup.template, task=task, transcript=transcript,
                         env_reward="none" if env_reward is None else f"{env_reward:g}")
    probabilities = setup.score == "probabilities"
    return _chat(setup, prompt, {"choice": list(rubric.DIGITS)}, 1 if probabilities else setup.max_tokens,
                 logprobs=probabilities)


def _message(reply: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise JudgeFailure(f"judge reply has no choices: {str(reply)[:200]}")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
    tokens = usage.get("total_tokens") if isinstance(usage.get("total_tokens"), int) else 0
    if message.get("refusal") or choice.get("finish_reason") == "content_filter":
        raise JudgeFailure(f"judge refused: {str(message.get('refusal') or choice.get('finish_reason'))[:200]}")
    return choice, message, tokens


def rubric_verdict(setup, reply: dict[str, Any]) -> Verdict:
    choice, message, tokens = _message(reply)
    content = message.get("content")
    answer = content.strip() if isinstance(content, str) else ""
    if setup.score == "probabilities":
        return _probabilities(choice, answer, tokens)
    if answer not in rubric.DIGITS:
        raise JudgeFailure(f"judge reply unparseable: {answer[:120]!r} is not one digit 0-9 (finish_reason "
                           f"{choice.get('finish_reason')}); does the endpoint honour structured_outputs?")
    return Verdict(rubric.score_of(answer), answer, None, tokens)


def _probabilities(choice: dict[str, Any], answer: str, tokens: int) -> Verdict:
    try:
        top = choice["logprobs"]["content"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise JudgeFailure("judge reply has no top log-probabilities for its answer token (JUDGE_SCORE="
                           "probabilities needs an endpoint that returns logprobs)") from None
    mass: dict[str, float] = {}
    for entry in top if isinstance(top, list) else []:
        token = str(entry.get("token", "")).strip() if isinstance(entry, dict) else ""
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if token in rubric.DIGITS and isinstance(logprob, (int, float)) and math.isfinite(logprob):
            mass[token] = mass.get(token, 0.0) + math.exp(logprob)
    total = sum(mass.values())
    if total <= 0:
        raise JudgeFailure(f"judge reply unparseable: no digit among the answer token's top {TOP_LOGPROBS} "
                           f"log-probabilities (answered {answer[:40]!r})")
    score = sum(p * rubric.score_of(d) for d, p in mass.items()) / total
    likeliest = sorted(mass.items(), key=lambda kv: -kv[1])[:3]
    why = "answer-token probabilities: " + ", ".join(f"{d} {p / total:.2f}" for d, p in likeliest)
    return Verdict(score, max(mass, key=mass.get), why, tokens)


# ---------------------------------------------------------------------------------------------------------- ranking
def ranking_request(setup, task: str, transcripts: list[str]) -> dict[str, Any]:
    episodes = "\n".join(f'<episode id="{i}">\n{text}\n</episode>' for i, text in enumerate(transcripts, 1))
    prompt = rubric.fill(setup.template, task=task, episodes=episodes, count=len(transcripts))
    n = len(transcripts)
    pattern = r"\[[0-9]" + (r"(, [0-9]){" + str(n - 1) + "}" if n > 1 else "") + r"\]"
    return _chat(setup, prompt, {"regex": pattern}, max(setup.max_tokens, 3 * n + 2))


def ranking_verdicts(reply: dict[str, Any], count: int) -> list[Verdict]:
    choice, message, tokens = _message(reply)
    content = message.get("content")
    try:
        digits = json.loads(content) if isinstance(content, str) else None
    except ValueError:
        digits = None
    if not (isinstance(digits, list) and len(digits) == count
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 9 for d in digits)):
        raise JudgeFailure(f"judge reply unparseable: {str(content)[:120]!r} is not a list of {count} digits "
                           f"(finish_reason {choice.get('finish_reason')})")
    share = tokens // max(1, count)
    return [Verdict(rubric.score_of(str(d)), str(d), f"ranked {d} of 9 beside its group: {digits}", share)
            for d in digits]


# ---------------------------------------------------------------------------------------------------- reward_model
def reward_model_request(setup, task: str, transcript: str) -> dict[str, Any]:
    return {"model": setup.model, "messages": [{"role": "user", "content": task},
                                               {"role": "assistant", "content": transcript}],
            "use_activation": False}  # raw logits, whatever activation the model's config asks (module docstring)


def reward_model_verdict(reply: dict[str, Any]) -> Verdict:
    try:
        logits = reply["data"][0]["probs"]  # vLLM's field name, raw logits with use_activation false
    except (KeyError, IndexError, TypeError):
        raise JudgeFailure(f"reward model reply has no data[0].probs: {str(reply)[:200]}") from None
    if not (isinstance(logits, list) and logits and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        and math.isfinite(v) for v in logits)):
        raise JudgeFailure(f"reward model reply unparseable: logits {str(logits)[:120]}")
    if max(abs(v) for v in logits) > MAX_LOGIT:
        raise JudgeFailure(f"reward model logits {str(logits)[:80]} are no trained head's (beyond +-{MAX_LOGIT:g}): "
                           "an uninitialised `score` head, as vLLM's --convert=classify gives a causal LM; serve a "
                           "sequence classifier")
    if len(logits) == 1:
        score = _sigmoid(logits[0])
        why = f"reward model logit {logits[0]:.4g}: sigmoid {score:.4f}"
    else:
        top = max(logits)
        weights = [math.exp(v - top) for v in logits]
        score = weights[-1] / sum(weights)
        why = f"classifier logits {[round(v, 3) for v in logits[:8]]}: last class's probability {score:.4f}"
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
    tokens = usage.get("total_tokens") if isinstance(usage.get("total_tokens"), int) else 0
    return Verdict(score, f"{logits[0]:.4g}" if len(logits) == 1 else f"{score:.4f}", why, tokens)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
