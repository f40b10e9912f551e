"""ROLLOUTS=async episodes under MAX_COMPLETION_LENGTH (#43 item 3): the stack's rollout loop (StackRolloutLoop, over
TRL 1.16's real async loop: generate loop, tool calls, scoring) against a stub of vLLM's /v1/completions that answers
as vLLM 0.31 does, a 400 past its max_model_len included. The model (scripted by the stub) calls a tool that returns
2,000 characters on every turn and MAX_TOOL_CALLING_ITERATIONS is unlimited: before the budget, such an episode grew
until vLLM refused it and TRL's worker retried the refusal for minutes."""

from __future__ import annotations

import json
import queue
import sys
import threading
from types import SimpleNamespace

import pytest
from accelerate.state import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import async_rollout_worker as trl_worker

from tests.trainer.worker_loops import run_loop
from trainer.rollouts.rewards import unfinished_penalty
from trainer.async_grpo.async_trainer import StackRolloutLoop

CALL = '<tool_call>\n{"name": "read_page", "arguments": {"page": 1}}\n</tool_call><|im_end|>'
ANSWER = "Done.<|im_end|>"
PAGE = ("lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40)[:2000]


def read_page(page: int) -> str:
    """Read one page of the document.

    Args:
        page: The page number.
    """
    return PAGE


class ClientError(Exception):
    """aiohttp's base error (aiohttp is not installed in the test venv): what TRL's `_retry` retries."""


class StubVLLM:
    """An aiohttp session's `post` to vLLM's /v1/completions: the scripted turn (`turns[k]` for the episode's k-th
    turn, the last one repeated; a read_page call by default) cut at max_tokens, or vLLM 0.31's 400 when prompt +
    max_tokens passes max_model_len."""

    def __init__(self, tokenizer, max_model_len: int, turns: tuple[str, ...] = (CALL,)) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.turns = [tokenizer.encode(turn, add_special_tokens=False) for turn in turns]
        self.requests: list[tuple[int, int, int]] = []  # (prompt tokens, max_tokens, status)
        self.payloads: list[dict] = []

    def post(self, url, json, timeout):
        assert url.endswith("/v1/completions") and json["max_tokens"] >= 1
        prompt, max_tokens = len(json["prompt"]), json["max_tokens"]
        self.payloads.append(json)
        if prompt + max_tokens > self.max_model_len:
            message = (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                       f"context length is {self.max_model_len} tokens and your request has {prompt} input tokens "
                       f"({max_tokens} > {self.max_model_len} - {prompt}).")
            self.requests.append((prompt, max_tokens, 400))
            return Reply(400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
        turn = self.tokenizer.decode(json["prompt"]).count("<|im_start|>assistant") - 1
        ids = self.turns[min(turn, len(self.turns) - 1)][:max_tokens]
        self.requests.append((prompt, max_tokens, 200))
        return Reply(200, {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]})


class Reply:
    def __init__(self, status: int, body: dict) -> None:
        self.status, self.body = status, body

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def text(self) -> str:
        return json.dumps(self.body)

    async def json(self) -> dict:
        return self.body

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise ClientError(f"{self.status}, message='Bad Request'")


@pytest.fixture
def make_loop(tiny_model_dir, monkeypatch):
    PartialState()  # as TRL's worker child does first
    aiohttp = SimpleNamespace(ClientTimeout=lambda total: total, ClientError=ClientError)  # what the loop uses of it
    monkeypatch.setitem(sys.modules, "aiohttp", aiohttp)
    monkeypatch.setattr(trl_worker, "aiohttp", aiohttp, raising=False)  # TRL's own _post (other paths)
    monkeypatch.setattr(trl_worker, "_RETRYABLE_HTTP_ERRORS", (ClientError,), raising=False)
    loops = []

    def make(budget: int, server_max_model_len: int, known_max_model_len: int | None, iterations: int | None = None,
             turns: tuple[str, ...] = (CALL,)):
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        rows = [{"prompt": [{"role": "user", "content": f"Summarise document {k}."}]} for k in range(4)]
        loop = StackRolloutLoop(
            model_name="tiny", dataset=Dataset.from_list(rows), tools=[read_page],
            reward_funcs=[unfinished_penalty(1.0, frozenset({stop}))], processing_class=tokenizer,
            eos_token_ids=[stop], rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
            heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(),
            exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(), num_generations=2,
            max_inflight_tasks=2, max_tokens=budget, max_tool_calling_iterations=iterations,
            max_model_len=known_max_model_len)
        loop.session = StubVLLM(loop.tokenizer, server_max_model_len, turns)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop._tool_pool.shutdown(wait=True)
        loop._loop.close()


def drain(q: queue.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def episodes_of(loop: StackRolloutLoop) -> list:
    """The trained samples, one per episode here (the scripted turns never drift)."""
    samples = drain(loop.rollout_buffer)
    assert samples and all(s.completion_mask.sum() > 0 for s in samples)
    return samples


def test_an_episode_of_2000_character_tool_results_ends_at_the_budget_and_the_loop_goes_on(make_loop):
    budget = 4000  # a 2,000-character result is ~1,500 tokens of the tiny model's tokenizer: two rounds fit, not three
    loop = make_loop(budget, server_max_model_len=8192, known_max_model_len=8192)
    run_loop(loop, samples_wanted=6)  # three groups scored: episodes end and generation goes on
    samples = episodes_of(loop)
    assert all(status == 200 for _, _, status in loop.session.requests)
    first = min(prompt for prompt, _, _ in loop.session.requests)
    for prompt, max_tokens, _ in loop.session.requests:
        assert prompt - first + max_tokens <= budget  # no turn may outgrow the episode's budget
    for sample in samples:
        completion = sample.completion
        calls = [m for m in completion if m["role"] == "assistant"]
        results = [m for m in completion if m["role"] == "tool"]
        assert len(calls) == 3 and len(results) == 2, "the third round's results are rolled back"
        assert completion[-1]["role"] == "assistant" and completion[-1].get("tool_calls")  # as the sync loop ends it
        prompt_len = int((sample.completion_mask.cumsum() == 0).sum())
        assert len(sample.input_ids) - prompt_len <= budget  # the episode, tool results included, fits its budget
        assert sample.completion_mask[-1] == 1  # no untrained tail of rolled-back results
        assert sample.metrics["reward"] == sample.metrics["reward"]  # scored (not NaN)


def test_a_turn_vllm_refuses_for_its_length_is_asked_again_within_it_and_never_retried(make_loop, capsys):
    """max_model_len unknown to the loop (preflight could not read it) and below prompt + budget: vLLM's 400 is not
    retried (TRL's worker retried it 30 x 3 times with backoff, ~8 minutes, then the run stopped); the turn is asked
    again within the max_model_len vLLM's message names, and episodes end where it is full, scored."""
    loop = make_loop(4000, server_max_model_len=2000, known_max_model_len=None)
    run_loop(loop, samples_wanted=4)
    samples = episodes_of(loop)
    refused = [r for r in loop.session.requests if r[2] == 400]
    assert 1 <= len(refused) <= loop.max_inflight_tasks  # only turns sent before the first refusal came back
    assert loop.max_model_len == 2000 and "max_model_len 2000" in capsys.readouterr().out
    assert loop._counters.get("rollout/vllm_retry_total", 0) == 0  # never retried
    for sample in samples:
        calls = [m for m in sample.completion if m["role"] == "assistant"]
        assert len(calls) == 2 and sample.completion[-1].get("tool_calls")  # the round past 2,000 rolled back
        assert len(sample.input_ids) <= 2000


def test_the_server_max_model_len_caps_each_turn_so_vllm_never_refuses(make_loop):
    """max_model_len known (preflight reads the server's) and below prompt + budget: each turn asks for what is left
    of it, the episode ends where the next prompt fills it, and vLLM never answers 400."""
    loop = make_loop(4096, server_max_model_len=900, known_max_model_len=900)
    run_loop(loop, samples_wanted=4)
    samples = episodes_of(loop)
    assert loop.session.requests and all(status == 200 for _, _, status in loop.session.requests)
    for sample in samples:
        assert len(sample.input_ids) <= 900
        assert [m["role"] for m in sample.completion] == ["assistant"]  # its one result did not fit: rolled back


def test_outside_an_episode_the_turn_is_trls_with_the_stacks_payload(make_loop):
    from trainer.gpu.grpo_kwargs import NEUTRAL_SAMPLING

    loop = make_loop(64, server_max_model_len=8192, known_max_model_len=None)
    loop.request_seeds = False  # the CPU rehearsal
    ids, logprobs = loop._loop.run_until_complete(loop._generate_one_turn([1, 2, 3]))
    assert ids and len(ids) == len(logprobs) and loop.session.requests == [(3, 64, 200)]
    [payload] = loop.session.payloads
    assert "seed" not in payload and NEUTRAL_SAMPLING.items() <= payload.items()


def test_a_turn_the_budget_cuts_short_is_scored_unfinished(make_loop):
    """As in sync mode, the turn that runs out of budget is cut (no stop token) and the unfinished penalty scores it."""
    probe = make_loop(8000, server_max_model_len=16384, known_max_model_len=None)
    run_loop(probe, samples_wanted=2)
    first, second = sorted({prompt for prompt, _, _ in probe.session.requests})[:2]
    loop = make_loop(second - first + 10, server_max_model_len=16384, known_max_model_len=None)
    run_loop(loop, samples_wanted=4)
    assert {max_tokens for prompt, max_tokens, _ in loop.session.requests if prompt == second} == {10}
    for sample in episodes_of(loop):
        assert sample.metrics["rewards/unfinished"] == -1.0
        assert len(sample.input_ids) - first <= second - first + 10


@pytest.mark.parametrize("budget, iterations, turns, calls, charged", [
    (4000, None, (CALL,), 3, -1.0),  # the third round's results would outgrow the budget: rolled back, episode ended
    (8000, 1, (CALL,), 2, -1.0),  # MAX_TOOL_CALLING_ITERATIONS reached: the second turn's call never runs
    (8000, None, (CALL, ANSWER), 2, 0.0),  # the model answered after its call: its own end, not the budget's
    (8000, 1, (ANSWER,), 1, 0.0),  # no call at all
])
def test_an_episode_is_charged_unfinished_when_a_budget_ended_it_and_only_then(make_loop, budget, iterations, turns,
                                                                              calls, charged):
    """As in sync mode (tests/trainer/test_rewards.py): an episode that ends on a tool-calling turn (that turn ends in
    a stop token) ended because of a budget, and is charged as a turn cut at the budget is."""
    loop = make_loop(budget, server_max_model_len=16384, known_max_model_len=None, iterations=iterations, turns=turns)
    run_loop(loop, samples_wanted=4)
    for sample in episodes_of(loop):
        assert len([m for m in sample.completion if m["role"] == "assistant"]) == calls
        assert sample.metrics["rewards/unfinished"] == charged


@pytest.mark.parametrize("body, limit", [
    ('{"error": {"message": "\'max_tokens\' or \'max_completion_tokens\' is too large: 300. This model\'s maximum '
     'context length is 2048 tokens and your request has 1900 input tokens (300 > 2048 - 1900).", "code": 400}}', 2048),
    ('{"error": {"message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make '
     'sure that `max_model_len` is no smaller than the number of text tokens.", "code": 400}}', 4096),
])
def test_vllms_length_refusals_are_told_apart_and_name_the_limit(body, limit):
    from trainer.async_grpo.async_budget import ContextFull, context_full, vllm_message

    assert context_full(400, body) and not context_full(500, body)
    assert not context_full(400, '{"error": {"message": "The model `x` does not exist.", "code": 404}}')
    assert ContextFull(vllm_message(body)).max_model_len == limit
    assert ContextFull("Bad Request").max_model_len is None


def test_a_group_that_calls_no_tool_counts_0_calls_in_the_step_figures(make_loop):
    """TRL's worker stamps tools/call_frequency and tools/failure_frequency only on groups that made a call and
    averages each key over the samples carrying it: a group of plain answers was left out (steps of such groups alone
    logged no tool figures; #46 item 3). The stack's loop stamps 0 on them (trainer.core.async_metrics.with_tool_metrics);
    a calling group keeps TRL's counts."""
    answering = make_loop(4000, server_max_model_len=8192, known_max_model_len=8192, turns=(ANSWER,))
    run_loop(answering, samples_wanted=4)
    for sample in episodes_of(answering):
        assert sample.metrics["tools/call_frequency"] == 0.0 and sample.metrics["tools/failure_frequency"] == 0.0
    calling = make_loop(4000, server_max_model_len=8192, known_max_model_len=8192, iterations=1, turns=(CALL, ANSWER))
    run_loop(calling, samples_wanted=4)
    assert all(sample.metrics["tools/call_frequency"] == 1.0 for sample in episodes_of(calling))


def test_a_turn_closed_at_the_workers_shutdown_outside_its_tasks_context_closes_quietly(make_loop, monkeypatch):
    """At an async run's end asyncio closes each pending rollout from outside its task's context: the turn cap's reset
    raised ValueError ("created in a different Context"), printed once per pending rollout at every run's end."""
    import contextvars

    from trainer.async_grpo.async_budget import EpisodeBudget, turn_cap

    class Pending:  # a turn waiting on vLLM when the worker stops
        def __await__(self):
            yield

    async def waiting_turn(prompt_ids):
        await Pending()

    loop = make_loop(64, 512, 512)
    monkeypatch.setattr(loop, "_generate_one_turn", waiting_turn)
    turn = loop._budgeted_turn([1, 2, 3], EpisodeBudget(64, 512))
    task_context = contextvars.copy_context()
    task_context.run(turn.send, None)  # suspended in the turn, its cap set in the task's context
    assert task_context.run(turn_cap) == 64
    turn.close()  # from another context, as at shutdown: no ValueError
    assert turn_cap() is None
