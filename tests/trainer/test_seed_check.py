"""#43 item 1: preflight says once when an env ignores `seed` (two resets with one seed, different observations): the
members of a GRPO group would play different episodes. An env that honours it, or a reset that fails or hangs, adds
no warning, and nothing here fails the run."""

from __future__ import annotations

import random
import time
from typing import Any, Optional

import pytest
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from contract.config import RunConfig
from envs import registry
from envs.core import probe
from envs.core.tool import reset_data
from tests.envs.inprocess import ThreadServer
from trainer.run import preflight
from trainer.run.preflight import PreflightReport

from .test_hostile_env import GUARD_S, hostile, wait_all_closed


class CoinAction(Action):
    """Flip.

    Attributes:
        side: heads or tails.
    """

    side: str


class CoinObservation(Observation):
    start: int = 0


class CoinEnvironment(Environment):
    """Starts each episode at a random number: from `seed` when SEEDED, else from nowhere. Shows its episode id (a
    fresh uuid per reset, as OpenEnv's State has it): the check must look past it."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    SEEDED = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CoinObservation:
        self._state = State(episode_id=str(random.random()), step_count=0)
        rng = random.Random(seed) if self.SEEDED else random.Random()
        return CoinObservation(start=rng.randrange(10**9), metadata={"episode_id": self._state.episode_id},
                               done=False, reward=0.0)

    def step(self, action: CoinAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CoinObservation:
        return CoinObservation(done=True, reward=1.0)

    @property
    def state(self) -> State:
        return self._state


class UnseededCoin(CoinEnvironment):
    SEEDED = False


def coin_server(env_class: type) -> ThreadServer:
    """Stock `create_app` (no capacity in /health: preflight counts sessions), as an upstream image serves an env."""
    return ThreadServer("coin", app=create_app(env_class, CoinAction, CoinObservation, env_name="coin",
                                               max_concurrent_envs=16))


def preflight_of(name: str, url: str, **values) -> tuple[list[str], PreflightReport, float]:
    values = {"max_completion_length": 1024, **values}  # above every env's episode budget: no warning of that kind
    cfg = RunConfig.load([], env_name=name, env_urls=f"{name}={url}", per_device_train_batch_size=4,
                         num_generations=4, **values)
    report = PreflightReport()
    t0 = time.monotonic()
    errors = preflight.check_env_servers(cfg, report, wait_s=0)
    return errors, report, time.monotonic() - t0


def test_an_env_that_ignores_seed_gets_one_warning_line():
    with coin_server(UnseededCoin) as server:
        errors, report, _ = preflight_of("coin", server.url)
    assert errors == []
    assert len(report.warnings) == 1, report.warnings
    line = report.warnings[0]
    assert line.startswith('env coin: two resets with the same kwargs {"seed": 42} gave different observations '
                           "(fields start): it ignores `seed`, so the members of a GRPO group play different "
                           "episodes and the group baseline compares different tasks"), line
    assert "nothing breaks, learning is noisier" in line and "Env author: make reset(seed=...)" in line
    assert "\n" not in line and "metadata" not in line  # the episode id differs too, and is not named
    assert "seeded" not in report.ok[0]


def test_an_env_that_honours_seed_adds_no_warning_and_says_so_on_its_line():
    with coin_server(CoinEnvironment) as server:
        errors, report, _ = preflight_of("coin", server.url)
    assert errors == [] and report.warnings == []
    assert report.ok[0].startswith("env coin: 1 replica(s) healthy; capacity") and \
        report.ok[0].endswith("this trainer opens; transport websocket (/ws sessions); resets seeded"), report.ok[0]


@pytest.mark.parametrize("name", ["echo", "catch"])  # wordle's server needs NLTK data: its image has it (see below)
def test_our_own_servers_honour_seed(name):
    with ThreadServer(name) as server:
        errors, report, _ = preflight_of(name, server.url)
    assert errors == [] and report.warnings == [], report.warnings
    assert report.ok[0].endswith("; resets seeded"), report.ok[0]


def test_the_check_resets_with_what_each_env_row_sends():
    """A built-in env's tool class maps its row (catch and wordle: the seed; echo: the target), a learned env sends the
    row's reset_kwargs: the check uses the class's own reset, without opening a session. Wordle seeds its secret from
    that seed (envs/wordle/server.py) and its reset observation is the rules text: it cannot differ."""
    for name in registry.names():
        spec = registry.get(name)
        row = spec.make_dataset(1, 7)[0]
        expected = {"target": row["target"]} if name == "echo" else {"seed": row["seed"]}
        assert reset_data(spec.tool_class, row) == expected, name
    from envs.generic import GenericSpec
    from envs.generic.interface import EnvInterface

    spec = GenericSpec("coin", EnvInterface("action", ()))
    assert reset_data(spec.tool_class, spec.make_dataset(2, 5)[1]) == {"seed": 6}


def test_a_reset_that_hangs_is_noted_in_bounded_time_and_its_session_closed():
    with hostile("slow_reply", HOSTILE_RESET_DELAY_S="600") as url:
        errors, report, took = preflight_of("hostile", url, reset_timeout_s=1)
        assert errors == [] and report.warnings == []
        assert "; seed not checked (" in report.ok[0] and "reset 1 got no answer within 1 s)" in report.ok[0]
        assert took < GUARD_S
        wait_all_closed(url)


@pytest.mark.parametrize("variant, says", [
    # its error frame, or the close right after it: whichever the client reads first
    ("reaped", ("reset 2 answered an error: Session closed", "the server closed the session")),
    ("huge_frame", ("a reply over the size limit",)),
])
def test_a_reset_that_errs_or_answers_too_much_is_noted_without_a_crash(variant, says):
    with hostile(variant) as url:
        errors, report, took = preflight_of("hostile", url)
        assert errors == [] and report.warnings == [], (errors, report.warnings)
        assert "; seed not checked (" in report.ok[0] and any(s in report.ok[0] for s in says), report.ok[0]
        assert took < GUARD_S
        wait_all_closed(url)


def test_the_whole_check_has_one_deadline(monkeypatch):
    """RESET_TIMEOUT_S bounds each reply; the check as a whole never outlasts its own deadline, whatever that is."""
    monkeypatch.setattr(probe, "SEED_CHECK_DEADLINE_S", 1.0)
    with hostile("slow_reply", HOSTILE_RESET_DELAY_S="600") as url:
        errors, report, took = preflight_of("hostile", url, reset_timeout_s=300)
        assert errors == [] and "; seed not checked (" in report.ok[0], report.ok[0]
        assert "within 1 s" in report.ok[0]
        wait_all_closed(url)
