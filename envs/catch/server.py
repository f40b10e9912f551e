"""Catch server: upstream OpenEnv `OpenSpielEnvironment` (catch, single player) on open-spiel 2.0.2.

Follows upstream envs/openspiel_env/server/openspiel_environment.py (BSD-3-Clause, Meta) for the
single-player case: same observation fields and values. Changes: the pyspiel game is loaded once per
process; `reset(seed=...)` seeds the ball's start column; steps run inline on the event loop (a
catch step is microseconds, a thread hop costs more); an out-of-range action or a step after the
episode ended raises a clear error (-> EXECUTION_ERROR frame) instead of an OpenSpiel abort.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment

from envs.catch.models import OpenSpielAction, OpenSpielObservation, OpenSpielState

GAME_NAME = "catch"
ACTIONS = {0: "left", 1: "stay", 2: "right"}


@functools.lru_cache(maxsize=1)
def _game() -> Any:
    import pyspiel

    return pyspiel.load_game(GAME_NAME)


class CatchEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    # One shared executor thread instead of one per session (pids limit); setup is cheap.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self) -> None:
        super().__init__()
        from open_spiel.python import rl_environment

        game = _game()
        self.game_name = GAME_NAME
        self.agent_player = 0
        self.game_params = dict(game.get_parameters())
        self._ospiel_env = rl_environment.Environment(game)
        self.num_players = self._ospiel_env.num_players
        self._state = OpenSpielState(
            game_name=GAME_NAME, agent_player=0, opponent_policy="random", game_params={}, num_players=self.num_players
        )
        self._time_step: Any = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> OpenSpielObservation:
        if seed is not None:
            self._ospiel_env.seed(int(seed) % (2**32))
        self._time_step = self._ospiel_env.reset()
        self._state.episode_id = episode_id or str(uuid.uuid4())
        self._state.step_count = 0
        return self._make_observation(self._time_step)

    def step(self, action: OpenSpielAction, timeout_s: Optional[float] = None, **kwargs: Any) -> OpenSpielObservation:  # type: ignore[override]
        if not isinstance(action, OpenSpielAction):
            raise ValueError(f"Expected OpenSpielAction, got {type(action)}")
        if self._time_step is None:
            raise RuntimeError("No episode yet: send a reset first.")
        if self._time_step.last():
            raise RuntimeError("The episode is over (done=true): send a reset before stepping again.")
        legal = self._time_step.observations["legal_actions"][self.agent_player]
        if action.action_id not in legal:
            raise ValueError(
                f"action_id {action.action_id} is not legal here; legal action ids: {legal} "
                f"({', '.join(f'{a}={ACTIONS.get(a, a)}' for a in legal)})."
            )
        self._time_step = self._ospiel_env.step([action.action_id])
        self._state.step_count += 1
        return self._make_observation(self._time_step)

    async def step_async(self, action: OpenSpielAction, timeout_s: Optional[float] = None, **kwargs: Any) -> OpenSpielObservation:  # type: ignore[override]
        return self.step(action)

    @property
    def state(self) -> OpenSpielState:
        return self._state

    def _make_observation(self, time_step: Any) -> OpenSpielObservation:
        info_state = time_step.observations["info_state"][self.agent_player]
        if time_step.last():
            game_phase = "terminal"
        elif time_step.first():
            game_phase = "initial"
        else:
            game_phase = "playing"
        reward = None
        if time_step.rewards is not None:
            reward = float(time_step.rewards[self.agent_player])
        return OpenSpielObservation(
            info_state=info_state.tolist() if hasattr(info_state, "tolist") else list(info_state),
            legal_actions=list(time_step.observations["legal_actions"][self.agent_player]),
            game_phase=game_phase,
            current_player_id=time_step.observations["current_player"],
            opponent_last_action=None,
            done=time_step.last(),
            reward=reward,
        )


def server_parts():
    _game()
    return CatchEnvironment, OpenSpielAction, OpenSpielObservation, OpenSpielState
