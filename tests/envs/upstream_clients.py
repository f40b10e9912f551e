"""Upstream OpenEnv clients (envs/textarena_env/client.py, envs/openspiel_env/client.py; BSD-3-Clause,
Meta), copied because upstream env packages are not installable here. Echo's upstream client is
openenv's own `MCPToolClient`. Models come from our envs/*/models.py, which are upstream's verbatim.
"""

from __future__ import annotations

from typing import Any, Dict

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from envs.catch.models import OpenSpielAction, OpenSpielObservation, OpenSpielState
from envs.wordle.models import TextArenaAction, TextArenaMessage, TextArenaObservation, TextArenaState

class TextArenaEnv(EnvClient[TextArenaAction, TextArenaObservation, TextArenaState]):
    """
    HTTP client for the TextArena Environment.

    This client connects to a TextArenaEnvironment HTTP server and provides
    methods to interact with it: reset(), step(), and state access.

    Example:
        >>> # Connect to a running server
        >>> client = TextArenaEnv(base_url="<ENV_HTTP_URL_HERE>")
        >>> result = client.reset()
        >>> print(result.observation.prompt)
        >>>
        >>> # Send an action
        >>> result = client.step(TextArenaAction(message="[crane]"))
        >>> print(result.observation.messages)
        >>> print(result.reward)

    Example with Docker:
        >>> # Automatically start container and connect
        >>> client = TextArenaEnv.from_docker_image("textarena-env:latest")
        >>> result = client.reset()
        >>> result = client.step(TextArenaAction(message="Test"))
    """

    def _step_payload(self, action: TextArenaAction) -> Dict:
        """
        Convert TextArenaAction to JSON payload for step request.

        Args:
            action: TextArenaAction instance

        Returns:
            Dictionary representation suitable for JSON encoding
        """
        return {
            "message": action.message,
        }

    def _parse_result(self, payload: Dict) -> StepResult[TextArenaObservation]:
        """
        Parse server response into StepResult[TextArenaObservation].

        Args:
            payload: JSON response from server

        Returns:
            StepResult with TextArenaObservation
        """
        obs_data = payload.get("observation", {})
        messages_payload = obs_data.get("messages", [])
        messages = [
            TextArenaMessage(
                sender_id=item.get("sender_id", -1),
                content=item.get("content", ""),
                category=item.get("category", "MESSAGE"),
            )
            for item in messages_payload
            if isinstance(item, dict)
        ]

        observation = TextArenaObservation(
            prompt=obs_data.get("prompt", ""),
            messages=messages,
            current_player_id=obs_data.get("current_player_id", 0),
            legal_players=obs_data.get("legal_players", []),
            info=obs_data.get("info", {}),
            reward=payload.get("reward"),
            done=payload.get("done", False),
            metadata=obs_data.get("metadata", {}),
        )
        return StepResult(
            observation=observation,
            reward=payload.get("reward"),
            done=payload.get("done", False),
        )

    def _parse_state(self, payload: Dict[str, Any]) -> TextArenaState:
        return TextArenaState(
            episode_id=payload.get("episode_id"),
            step_count=payload.get("step_count", 0),
            env_id=payload.get("env_id", "unknown"),
            num_players=payload.get("num_players", 1),
            max_turns=payload.get("max_turns"),
            turn=payload.get("turn", 0),
            last_reward=payload.get("last_reward", 0.0),
            last_info=payload.get("last_info", {}),
            raw_state=payload.get("raw_state", {}),
        )

class OpenSpielEnv(EnvClient[OpenSpielAction, OpenSpielObservation, OpenSpielState]):
    """
    Client for OpenSpiel Environment.

    This client maintains a persistent WebSocket connection to the environment
    server, enabling efficient multi-step interactions with lower latency.

    Example:
        >>> # Connect to a running server
        >>> with OpenSpielEnv(base_url="http://localhost:8000") as client:
        ...     result = client.reset()
        ...     print(result.observation.info_state)
        ...
        ...     result = client.step(OpenSpielAction(action_id=1, game_name="catch"))
        ...     print(result.observation.reward)

    Example with Docker:
        >>> # Automatically start container and connect
        >>> client = OpenSpielEnv.from_docker_image("openspiel-env:latest")
        >>> try:
        ...     result = client.reset()
        ...     result = client.step(OpenSpielAction(action_id=0))
        ... finally:
        ...     client.close()
    """

    def _step_payload(self, action: OpenSpielAction) -> Dict[str, Any]:
        """
        Convert OpenSpielAction to JSON payload for step request.

        Args:
            action: OpenSpielAction instance.

        Returns:
            Dictionary representation suitable for JSON encoding.
        """
        return {
            "action_id": action.action_id,
            "game_name": action.game_name,
            "game_params": action.game_params,
        }

    def _parse_result(
        self, payload: Dict[str, Any]
    ) -> StepResult[OpenSpielObservation]:
        """
        Parse server response into StepResult[OpenSpielObservation].

        Args:
            payload: JSON response from server.

        Returns:
            StepResult with OpenSpielObservation.
        """
        obs_data = payload.get("observation", {})

        observation = OpenSpielObservation(
            info_state=obs_data.get("info_state", []),
            legal_actions=obs_data.get("legal_actions", []),
            game_phase=obs_data.get("game_phase", "playing"),
            current_player_id=obs_data.get("current_player_id", 0),
            opponent_last_action=obs_data.get("opponent_last_action"),
            done=payload.get("done", False),
            reward=payload.get("reward"),
            metadata=obs_data.get("metadata", {}),
        )

        return StepResult(
            observation=observation,
            reward=payload.get("reward"),
            done=payload.get("done", False),
        )

    def _parse_state(self, payload: Dict[str, Any]) -> OpenSpielState:
        """
        Parse server response into OpenSpielState object.

        Args:
            payload: JSON response from /state endpoint.

        Returns:
            OpenSpielState object with environment state information.
        """
        return OpenSpielState(
            episode_id=payload.get("episode_id"),
            step_count=payload.get("step_count", 0),
            game_name=payload.get("game_name", "unknown"),
            agent_player=payload.get("agent_player", 0),
            opponent_policy=payload.get("opponent_policy", "random"),
            game_params=payload.get("game_params", {}),
            num_players=payload.get("num_players", 1),
        )
