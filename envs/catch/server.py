"""Catch server: upstream OpenEnv `OpenSpielEnvironment` (catch, single player) on open-spiel 2.0.2.

Follows upstream envs/openspiel_env/server/openspiel_environment.py (BSD-3-Clause, Meta) for the
single-player case: same observation fields and values. Upstream drives the game through OpenSpiel's
`rl_environment.Environment`; we call the same pyspiel state methods it calls (observation_tensor,
legal_actions, current_player, rewards; chance nodes sampled by its `ChanceEventSampler`), without
its per-step bookkeeping. As upstream, a step before any reset (every HTTP `POST /step`: a fresh env
per call) starts an episode and answers its first observation. tests/envs/test_env_units.py plays both side by side and requires identical
observations. Other changes: the pyspiel game is loaded once per process; `reset(seed=...)` seeds the
ball's start column (reseeding in place); resets and steps run inline on the event loop (each is tens
of microseconds; a hop to the executor thread and back costs more); an out-of-range action or a step
after the episode ended raises a clear error (-> EXECUTION_ERROR frame) instead of an OpenSpiel abort.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any, Optional

import numpy as np
from open_spiel.python import rl_environment
from openenv.core.env_server.interfaces import Environment

from envs.catch.models import OpenSpielAction, OpenSpielObservation, OpenSpielState

GAME_NAME = "catch"
ACTIONS = {0: "left", 1: "stay", 2: "right"}
AGENT = 0  # the single player


class InPlaceSeedSampler(rl_environment.ChanceEventSampler):
    """Upstream's chance-event sampler, reseeded in place.

    Upstream builds a new `np.random.RandomState(seed)` on every seeded reset (~145 µs, a third of a
    Catch episode's server CPU); `RandomState.seed(seed)` on the existing one gives the same draws in ~2 µs.
    """

    def seed(self, seed: Optional[int] = None) -> None:
        rng = getattr(self, "_rng", None)
        if rng is None:  # called from __init__
            self._rng = np.random.RandomState(seed)
        else:
            rng.seed(seed)


@functools.lru_cache(maxsize=1)
def _game() -> Any:
    import pyspiel

    game = pyspiel.load_game(GAME_NAME)
    # rl_environment's info_state is the information-state tensor when a game has one, else the
    # observation tensor (catch); _make_observation reads the latter.
    if game.get_type().provides_information_state_tensor:
        raise RuntimeError(f"{GAME_NAME} now has an information-state tensor: read that, as rl_environment does")
    return game


class CatchEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    # One shared executor thread instead of one per session (pids limit); setup is cheap.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self) -> None:
        super().__init__()
        self._game_obj = _game()
        self._sample_chance = InPlaceSeedSampler()
        self._state = OpenSpielState(
            game_name=GAME_NAME, agent_player=0, opponent_policy="random", game_params={}, num_players=1
        )
        self._ps: Any = None  # the pyspiel state of the current episode

    def _settle_chance(self) -> None:
        # rl_environment's _sample_external_events: play out chance nodes (catch: the ball's column)
        while self._ps.is_chance_node():
            self._ps.apply_action(self._sample_chance(self._ps))

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> OpenSpielObservation:
        if seed is not None:
            self._sample_chance.seed(int(seed) % (2**32))
        self._ps = self._game_obj.new_initial_state()
        self._settle_chance()
        self._state.episode_id = episode_id or str(uuid.uuid4())
        self._state.step_count = 0
        return self._make_observation(first=True)

    def step(self, action: OpenSpielAction, timeout_s: Optional[float] = None, **kwargs: Any) -> OpenSpielObservation:  # type: ignore[override]
        if not isinstance(action, OpenSpielAction):
            raise ValueError(f"Expected OpenSpielAction, got {type(action)}")
        if self._ps is None:
            # Upstream's rl_environment starts an episode on a step before any reset and ignores the
            # action (TimeStep FIRST); stock HTTP /step is always such a step (a fresh env per call).
            self.reset()
            self._state.step_count = 1
            return self._make_observation(first=True)
        if self._ps.is_terminal():
            raise RuntimeError("The episode is over (done=true): send a reset before stepping again.")
        legal = self._ps.legal_actions(AGENT)
        if action.action_id not in legal:
            raise ValueError(
                f"action_id {action.action_id} is not legal here; legal action ids: {legal} "
                f"({', '.join(f'{a}={ACTIONS.get(a, a)}' for a in legal)})."
            )
        self._ps.apply_action(action.action_id)
        self._settle_chance()
        self._state.step_count += 1
        return self._make_observation(first=False)

    async def reset_async(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> OpenSpielObservation:  # type: ignore[override]
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    async def step_async(self, action: OpenSpielAction, timeout_s: Optional[float] = None, **kwargs: Any) -> OpenSpielObservation:  # type: ignore[override]
        return self.step(action)

    @property
    def state(self) -> OpenSpielState:
        return self._state

    def _make_observation(self, first: bool) -> OpenSpielObservation:
        # rl_environment's TimeStep, as upstream reads it: FIRST has no rewards; LAST when terminal
        ps = self._ps
        done = ps.is_terminal()
        return OpenSpielObservation(
            info_state=ps.observation_tensor(AGENT),
            legal_actions=ps.legal_actions(AGENT),
            game_phase="terminal" if done else "initial" if first else "playing",
            current_player_id=ps.current_player(),
            opponent_last_action=None,
            done=done,
            reward=None if first else float(ps.rewards()[AGENT]),
        )


def server_parts():
    _game()  # load the game before the first session
    return CatchEnvironment, OpenSpielAction, OpenSpielObservation, OpenSpielState
