"""The rubric files (prompts/judge/, JUDGE_RUBRIC): Python format templates. `check` is the preflight's: every
placeholder known to the method, the required ones present, literal braces doubled.

The scale is fixed: the judge answers one digit, 0 (worst) to 9 (best), the score is digit / 9. One digit is one
token in every tokenizer we know, so the constrained choice is one short reply and JUDGE_SCORE=probabilities can read
the whole distribution from the first answer token's top log-probabilities."""

from __future__ import annotations

import string

DIGITS = tuple(str(d) for d in range(10))
PLACEHOLDERS = {"rubric": {"task", "transcript", "env_reward"}, "ranking": {"task", "episodes", "count"}}
REQUIRED = {"rubric": {"transcript"}, "ranking": {"episodes"}}


class RubricError(ValueError):
    """A rubric that cannot be used, in one line with its fix."""


def score_of(digit: str) -> float:
    return int(digit) / 9.0


def fields(template: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise RubricError(f"{exc} (a literal brace is written twice: {{{{ or }}}})") from None


def check(template: str, method: str, where: str) -> None:
    """Raise RubricError when `template` cannot serve `method` (rubric, ranking); reward_model reads none."""
    if method not in PLACEHOLDERS:
        return
    if not template.strip():
        raise RubricError(f"the rubric {where} is missing or empty: write one (prompts/judge/README.md) or set "
                          "JUDGE_RUBRIC to an existing file under prompts/")
    try:
        named = fields(template)
    except RubricError as exc:
        raise RubricError(f"the rubric {where} does not parse: {exc}") from None
    unknown = sorted(named - PLACEHOLDERS[method])
    if unknown:
        raise RubricError(f"the rubric {where} names {', '.join('{' + n + '}' for n in unknown)}, which "
                          f"JUDGE_METHOD={method} does not fill (it fills "
                          f"{', '.join('{' + n + '}' for n in sorted(PLACEHOLDERS[method]))}); fix the file "
                          "(a literal brace is written twice)")
    missing = sorted(REQUIRED[method] - named)
    if missing:
        raise RubricError(f"the rubric {where} lacks {', '.join('{' + n + '}' for n in missing)}: the judge would "
                          "never see the episode; add it inside the rubric's data block")


def fill(template: str, **values: object) -> str:
    return template.format(**values)
