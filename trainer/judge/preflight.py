"""The judge's checks before the first step (trainer.run.preflight calls `check`), each problem one line with its fix:
the rubric parses (its placeholders known to JUDGE_METHOD), the judge answers (/v1/models, then one scored call on a
made-up episode, which shows the endpoint honours the constraint), and its max_model_len fits the longest transcript
the episode budget allows plus the rubric and the reply."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.config import RunConfig
from trainer.judge import methods, rubric, transcript
from trainer.judge.client import JudgeFailure, client_for
from trainer.judge.setup import JudgeSetup, from_config, rubric_path

TEMPLATE_OVERHEAD_TOKENS = 32  # the chat template's turn markers around the judge's one message
NOT_A_CLASSIFIER = ("needs a sequence classifier served by vLLM's pooling runner (/classify): JUDGE_MODEL's "
                    "config.json `architectures` must end in ForSequenceClassification (a reward model: num_labels "
                    "1); a causal LM is served as an embedding model, without /classify (docs/judge.md \"A reward "
                    "model\")")
FIX_REACH = ("start the judge (`make up`; `make logs` for the judge service shows why it is not ready) or fix "
             "JUDGE_URL and its key file (edit .env)")


@dataclass
class JudgeCheck:
    errors: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)
    model: str | None = None  # the id the judge serves


def check(cfg: RunConfig, prompt_tokens: int | None) -> JudgeCheck:
    """`prompt_tokens`: the longest dataset prompt in the policy's tokens (None: unknown; the length check then counts
    the completion budget alone)."""
    out = JudgeCheck()
    setup = from_config(cfg)
    if setup is None:
        return out
    where = str(rubric_path(cfg.judge_rubric))
    try:
        rubric.check(setup.template, setup.method, where)
        if setup.method != "reward_model":
            out.ok.append(f"judge rubric {where}: parses ({setup.method})")
    except rubric.RubricError as exc:
        out.errors.append(str(exc))
        return out
    client = client_for(setup.base_url, setup.root_url, setup.timeout_s, setup.api_key_file, setup.concurrency)
    try:
        out.model, max_len = client.served_model()
    except JudgeFailure as exc:
        out.errors.append(f"judge at {setup.base_url} does not answer: {exc}; {FIX_REACH}")
        return out
    setup = setup.with_model(out.model)
    try:
        verdict = _one_call(client, setup)
    except JudgeFailure as exc:
        # a judge that stopped answering between the two calls (killed, restarting) is not missing a feature
        needs = NOT_A_CLASSIFIER if setup.method == "reward_model" else "needs vLLM's structured outputs"
        fix = FIX_REACH if exc.reason.startswith(("judge unreachable", "judge timeout")) else \
            f"JUDGE_METHOD={setup.method} {needs}"
        out.errors.append(f"judge {out.model} at {setup.base_url} answers /v1/models but scored no test episode: "
                          f"{exc}; {fix}")
        return out
    out.ok.append(f"judge {out.model} at {setup.base_url}: answers ({setup.method}, test episode scored "
                  f"{verdict.score:.2f})")
    if max_len:
        line, problem = fits(cfg, setup, client, prompt_tokens, max_len)
        (out.errors if problem else out.ok).append(line)
    return out


def _one_call(client, setup: JudgeSetup) -> methods.Verdict:
    task, text = "Say hello.", transcript.render([{"role": "assistant", "content": "Hello."}])
    if setup.method == "ranking":
        return methods.ranking_verdicts(client.post("/chat/completions",
                                                    methods.ranking_request(setup, task, [text, text])), 2)[0]
    if setup.method == "reward_model":
        return methods.reward_model_verdict(client.post("/classify", methods.reward_model_request(setup, task, text),
                                                        root=True))
    return methods.rubric_verdict(setup, client.post("/chat/completions",
                                                     methods.rubric_request(setup, task, text, 1.0)))


def rubric_tokens(client, setup: JudgeSetup) -> int:
    """The rubric's own tokens in the judge's tokenizer (vLLM's /tokenize), else a safe guess (one per 3 chars)."""
    empty = rubric.fill(setup.template, **dict.fromkeys(rubric.PLACEHOLDERS.get(setup.method, ()), ""))
    try:
        count = client.post("/tokenize", {"model": setup.model, "prompt": empty}, root=True).get("count")
    except JudgeFailure:
        count = None
    return count if isinstance(count, int) else len(empty) // 3 + 1


def fits(cfg: RunConfig, setup: JudgeSetup, client, prompt_tokens: int | None, max_len: int) -> tuple[str, bool]:
    """(the line, whether it is a problem): the judge's worst request against its max_model_len. An episode is at most
    its prompt + MAX_COMPLETION_LENGTH policy tokens, and the transcript is cut at TRANSCRIPT_CHARS characters (a token
    is at least a character); a ranking call carries NUM_GENERATIONS of them."""
    episode = min((prompt_tokens or 0) + cfg.max_completion_length,
                  transcript.TRANSCRIPT_CHARS + transcript.TASK_CHARS)
    episodes = episode * (setup.num_generations if setup.method == "ranking" else 1)
    reply = 0 if setup.method == "reward_model" else setup.max_tokens
    fixed = (0 if setup.method == "reward_model" else rubric_tokens(client, setup)) + TEMPLATE_OVERHEAD_TOKENS
    total = episodes + fixed + reply
    line = (f"judge lengths: longest {'group of episodes' if setup.method == 'ranking' else 'episode'} {episodes} "
            f"(policy tokens; the judge's tokenizer may differ) + rubric and template {fixed} + reply {reply} = {total}")
    if total > max_len:
        return (f"{line} > the judge's max_model_len {max_len}: long episodes would be refused (judge failures, "
                f"left out); serve the judge with a longer context, or lower MAX_COMPLETION_LENGTH"
                f"{', or use JUDGE_METHOD=rubric (one episode a call)' if setup.method == 'ranking' else ''} "
                "(edit .env)"), True
    return f"{line} <= the judge's max_model_len {max_len}", False
