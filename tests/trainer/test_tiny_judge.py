"""trainer.tiny_judge's and trainer.tiny_reward_model's data (the judge calls they learn from are the trainer's own
renders) and model-init's hooks; the judge's learning on the twin is tests/trainer/test_judge_learning.py (docker), the
reward model on the twin bench/reward_model.py."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

from contract.config.judge import DEFAULT_RUBRIC, TINY_JUDGE
from trainer import tiny_judge, tiny_model
from trainer.judge import methods, transcript


def test_examples_are_the_trainers_rubric_calls_with_the_env_reward_apart_from_the_grade():
    setup = tiny_judge.judge_setup(DEFAULT_RUBRIC)
    items = tiny_judge.examples(setup, 90, seed=3)
    assert {kind for _, _, kind in items} == {"right", "wrong", "none"}
    for messages, digit, kind in items:
        assert digit == tiny_judge.GRADES[kind]
        text = messages[0]["content"]
        assert "<transcript>" in text and "Use the echo tool to say the word:" in text
        assert ("[assistant calls] echo_message(" in text) == (kind != "none")
    # the same render trainer.judge.reward sends for an episode
    completion = tiny_judge.episode("right", "river", random.Random(1))
    sent = methods.rubric_request(setup, "Use the echo tool to say the word: river", transcript.render(completion), 0.2)
    assert tiny_judge.rendered(setup, [{"role": "user", "content": "Use the echo tool to say the word: river"}],
                               completion, 0.2) == sent["messages"]
    # the env's reward the rubric shows says nothing about the grade: every grade is seen beside several rewards
    shown = {(digit, m[0]["content"].split("reward for this episode was: ")[1].split("\n")[0]) for m, digit, _ in items}
    for digit in tiny_judge.GRADES.values():
        assert len({reward for d, reward in shown if d == digit}) >= 3, shown


def test_model_init_makes_the_tiny_judge_only_when_judge_model_names_it(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(argv) or SimpleNamespace(returncode=0))
    assert tiny_model.tiny_judge_if_named(SimpleNamespace(judge_model=None, judge_rubric=DEFAULT_RUBRIC)) == 0
    assert tiny_model.tiny_judge_if_named(SimpleNamespace(judge_model="/models/tiny-qwen3",
                                                          judge_rubric=DEFAULT_RUBRIC)) == 0
    assert calls == []
    assert tiny_model.tiny_judge_if_named(SimpleNamespace(judge_model=TINY_JUDGE, judge_rubric="prompts/x.md")) == 0
    assert calls[0][1:] == ["-m", "trainer.tiny_judge", "--out", TINY_JUDGE, "--rubric", "prompts/x.md"]


def test_model_init_makes_the_tiny_reward_model_on_the_policys_trunk_only_when_judge_model_names_it(monkeypatch):
    from contract.config.judge import TINY_REWARD_MODEL

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(argv) or SimpleNamespace(returncode=0))
    policy = Path("/models/tiny-qwen3")
    assert tiny_model.tiny_reward_model_if_named(SimpleNamespace(judge_model=TINY_JUDGE), policy) == 0
    assert calls == []
    assert tiny_model.tiny_reward_model_if_named(SimpleNamespace(judge_model=TINY_REWARD_MODEL + "/"), policy) == 0
    assert calls[0][1:] == ["-m", "trainer.tiny_reward_model", "--base", str(policy), "--out", TINY_REWARD_MODEL]


def test_the_tiny_reward_model_learns_from_the_requests_the_trainer_sends_to_classify():
    from trainer import tiny_reward_model

    items = tiny_reward_model.episodes(9, seed=5)
    assert [kind for _, _, kind in items] == list(tiny_judge.KINDS) * 3
    prompt, completion, _ = items[0]
    setup = SimpleNamespace(model="rm")
    sent = methods.reward_model_request(setup, transcript.task_of(prompt), transcript.render(completion))
    assert tiny_reward_model.request_messages(prompt, completion) == sent["messages"]
    assert "[assistant calls] echo_message" in sent["messages"][1]["content"]  # a right first call, rendered

