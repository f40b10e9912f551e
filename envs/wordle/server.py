"""Wordle server: upstream OpenEnv `TextArenaEnvironment` behaviour and wire schema, built for load.

Upstream's environment (envs/textarena_env/server/environment.py, BSD-3-Clause, Meta) is followed
step for step (observation building, message conversion, reward signals), with three changes:
- construction is cheap: textarena's `WordleEnv.__init__` re-reads the NLTK word lists, POS-tags the
  secret list and parses two Hunspell dictionaries (~1 s of CPU under the GIL) per session, and calls
  `nltk.download` (network). Here that data is built ONCE per process (`_shared_data`) and shared;
- `reset(seed=...)` picks the secret word from a per-session RNG (upstream ignores the seed, and
  textarena's own seeding would reseed the process-global RNG for every session);
- a step after the episode ended raises a clear error (-> EXECUTION_ERROR frame) instead of
  mutating a finished game.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Dict, Iterable, List, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment

from envs.core import DATA_ROOT
from envs.wordle.models import TextArenaAction, TextArenaMessage, TextArenaObservation, TextArenaState
from envs.wordle.upstream_rewards import RewardProvider, build_reward_providers

ENV_ID = "Wordle-v0"
WORD_LENGTH = 5
NUM_GUESSES = 6

_shared: Optional[tuple] = None
_shared_lock = threading.Lock()


def _shared_data() -> tuple:
    """(WordleEnv subclass, secret words, dictionary), built once per process."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            return _shared
        import nltk

        # build_data.py's NLTK data, baked into the image; first, so textarena's import finds it and downloads nothing
        nltk.data.path.insert(0, str(DATA_ROOT / "wordle"))
        import textarena as ta
        from textarena.envs.utils.word_lists import EnglishDictionary
        from textarena.envs.Wordle.env import WordleEnv
        from textarena.wrappers import ActionFormattingWrapper, LLMObservationWrapper

        from envs.wordle.words import SECRET_WORDS

        # EnglishDictionary() would nltk.download("words"); build the same sets without it.
        dictionary = EnglishDictionary.__new__(EnglishDictionary)
        dictionary.include_nltk, dictionary.keep_non_alpha, dictionary.keep_proper_nouns = True, False, False
        dictionary.uk_words = dictionary._load_dic("en_GB.dic", "en.aff")
        dictionary.us_words = dictionary._load_dic("en_US.dic", "en.aff")
        dictionary.nltk_words = dictionary._load_nltk(basic=False)
        dictionary.nltk_basic_words = dictionary._load_nltk(basic=True)
        secrets = [w for w in SECRET_WORDS if len(w) == WORD_LENGTH and dictionary.is_english_word(w)]

        class SharedDataWordle(WordleEnv):
            def __init__(self) -> None:
                ta.Env.__init__(self)
                self.word_length, self.num_guesses = WORD_LENGTH, NUM_GUESSES
                self.word_list, self.dictionary = secrets, dictionary  # read-only, shared
                self.rng = random.Random()

            def reset(self, num_players: int = 1, seed: Optional[int] = None) -> None:
                if seed is not None:
                    self.rng.seed(seed)
                self.state = ta.SinglePlayerState(num_players=num_players, seed=None)
                game_state = {
                    "secret_word": self.rng.choice(self.word_list),
                    "guess_history": [],
                    "word_length": self.word_length,
                    "num_guesses": self.num_guesses,
                }
                self.state.reset(game_state=game_state, player_prompt_function=self._generate_player_prompt)

        def make() -> Any:  # the wrappers ta.make("Wordle-v0") applies, in its order
            return ActionFormattingWrapper(LLMObservationWrapper(SharedDataWordle()))

        _shared = (make, secrets, dictionary)
        return _shared


class WordleEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    # One shared executor thread instead of one per session (pids limit); env setup is now cheap.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self) -> None:
        super().__init__()
        make, _, _ = _shared_data()
        self.env_id = ENV_ID
        self.num_players = 1
        self.max_turns: Optional[int] = None
        self._ta_env = make()
        self._state = TextArenaState(env_id=ENV_ID, num_players=1, max_turns=None)
        self._reward_providers: List[RewardProvider] = build_reward_providers(ENV_ID)
        self._last_reward_signals: Dict[str, float] = {}
        self._done = False
        self._ta_env.reset(num_players=self.num_players)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> TextArenaObservation:
        env = self._ta_env
        while hasattr(env, "env"):  # upstream: wrappers keep history across resets
            if hasattr(env, "full_observations"):
                env.full_observations = {}
            env = env.env
        if hasattr(env, "full_observations"):
            env.full_observations = {}
        self._ta_env.reset(num_players=self.num_players, seed=seed)
        for provider in self._reward_providers:
            provider.reset()
        self._state.episode_id = episode_id if episode_id is not None else str(uuid4())
        self._state.step_count = 0
        self._state.turn = 0
        self._state.last_reward = 0.0
        self._state.last_info = {}
        self._state.raw_state = self._snapshot_state()
        self._last_reward_signals = {}
        self._done = False
        observation = self._build_observation()
        observation.reward = 0.0
        observation.done = False
        return observation

    def step(self, action: TextArenaAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextArenaObservation:  # type: ignore[override]
        if not isinstance(action, TextArenaAction):
            raise TypeError(f"Expected TextArenaAction, received {type(action)!r}")
        if self._done:
            raise RuntimeError("The episode is over (done=true): send a reset before stepping again.")
        done, info = self._ta_env.step(action.message)
        self._done = bool(done)
        self._state.step_count += 1
        self._state.turn = getattr(self._ta_env.state, "turn", self._state.turn + 1)
        self._state.last_info = info or {}
        observation = self._build_observation()
        observation.done = done
        reward = self._extract_reward()
        observation.reward = reward
        self._state.last_reward = reward
        reward_signals = self._compute_reward_signals(action=action, observation=observation)
        if reward_signals:
            observation.info.setdefault("reward_signals", {}).update(reward_signals)
            observation.metadata.setdefault("reward_signals", {}).update(reward_signals)
        self._last_reward_signals = reward_signals
        if reward_signals:
            self._state.last_info = {**(self._state.last_info or {}), "reward_signals": reward_signals}
        self._state.raw_state = self._snapshot_state()
        return observation

    async def step_async(self, action: TextArenaAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextArenaObservation:  # type: ignore[override]
        return self.step(action)  # a dictionary lookup and some strings: cheaper than a thread hop

    @property
    def state(self) -> TextArenaState:
        return self._state

    # -- upstream helpers, unchanged ------------------------------------------------------------
    def _build_observation(self) -> TextArenaObservation:
        player_id, messages = self._ta_env.get_observation()
        ta_messages = self._convert_messages(messages)
        prompt_lines = [msg.content for msg in ta_messages if msg.category == "PROMPT"]
        if not prompt_lines:
            current_turn = getattr(self._ta_env.state, "turn", 0)
            if current_turn == 0 and ta_messages:
                prompt_lines = [ta_messages[0].content]
            else:
                prompt_lines = [self.env_id]
        prompt = "\n".join(prompt_lines).strip()
        info: Dict[str, Any] = {}
        info.update(getattr(self._ta_env.state, "step_info", {}))
        return TextArenaObservation(
            prompt=prompt,
            messages=ta_messages,
            current_player_id=player_id,
            legal_players=self._legal_players(),
            info=info,
            metadata={
                "env_id": self.env_id,
                "turn": getattr(self._ta_env.state, "turn", 0),
                "raw_messages": [
                    {"sender_id": m.sender_id, "content": m.content, "category": m.category} for m in ta_messages
                ],
            },
        )

    def _legal_players(self) -> List[int]:
        role_mapping = getattr(self._ta_env.state, "role_mapping", {}) or {}
        return sorted(pid for pid in role_mapping.keys() if isinstance(pid, int) and pid >= 0)

    def _convert_messages(self, messages: Iterable[Any]) -> List[TextArenaMessage]:
        converted: List[TextArenaMessage] = []
        buffered_sender: int | None = None
        buffered_category: str | None = None
        buffered_content: List[str] = []

        def flush_buffer() -> None:
            nonlocal buffered_content, buffered_sender, buffered_category
            if not buffered_content:
                return
            converted.append(
                TextArenaMessage(
                    sender_id=buffered_sender if buffered_sender is not None else -1,
                    content="".join(buffered_content),
                    category=buffered_category or "MESSAGE",
                )
            )
            buffered_content, buffered_category, buffered_sender = [], None, None

        for entry in messages:
            if isinstance(entry, tuple) and len(entry) == 3:
                sender, content, category = entry
            elif isinstance(entry, tuple) and len(entry) == 2:
                sender, content = entry
                category = "MESSAGE"
            else:
                sender, content, category = -1, str(entry), "MESSAGE"
            category_name = getattr(category, "name", str(category))
            sender_id = int(sender) if isinstance(sender, (int, float)) else -1
            text = str(content)
            if buffered_content and buffered_category == category_name and buffered_sender == sender_id:
                buffered_content.append(text)
            else:
                flush_buffer()
                buffered_sender, buffered_category, buffered_content = sender_id, category_name, [text]
        flush_buffer()
        return converted

    def _extract_reward(self) -> float:
        rewards = getattr(self._ta_env.state, "rewards", None)
        if isinstance(rewards, dict):
            player_id = getattr(self._ta_env.state, "current_player_id", 0)
            if player_id in rewards:
                return float(rewards[player_id])
            if 0 in rewards:
                return float(rewards[0])
        return 0.0

    def _snapshot_state(self) -> Dict[str, Any]:
        state = self._ta_env.state
        snapshot: Dict[str, Any] = {
            "turn": getattr(state, "turn", 0),
            "game_state": getattr(state, "game_state", {}),
            "logs": list(getattr(state, "logs", [])),
            "rewards": getattr(state, "rewards", None),
            "done": getattr(state, "done", False),
            "role_mapping": getattr(state, "role_mapping", {}),
            "game_info": getattr(state, "game_info", {}),
            "step_info": getattr(state, "step_info", {}),
        }
        if self._last_reward_signals:
            snapshot["reward_signals"] = dict(self._last_reward_signals)
        return snapshot

    def _compute_reward_signals(self, *, action: TextArenaAction, observation: TextArenaObservation) -> Dict[str, float]:
        aggregated: Dict[str, float] = {}
        for provider in self._reward_providers:
            try:
                result = provider.compute(action=action, observation=observation)
            except Exception:  # pragma: no cover - upstream is defensive here too
                continue
            for key, value in result.items():
                aggregated[key] = float(value)
        return aggregated


def server_parts():
    _shared_data()  # pay the one-off cost at startup, not in the first session
    return WordleEnvironment, TextArenaAction, TextArenaObservation, TextArenaState
