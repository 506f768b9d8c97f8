"""The guessing game as an OpenEnv `Environment`: reset picks the secret (from the seed), step scores one guess.

Each WebSocket session of the server gets its own instance (OpenEnv's factory mode), so sessions share nothing:
SUPPORTS_CONCURRENT_SESSIONS lets the app allow several at once.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from miles_guess_number.models import GuessAction, GuessObservation, GuessState

_INTEGER = re.compile(r"-?\d+")
MAX_HIGH = 1_000_000


def read_guess(text: str) -> int | None:
    """The last integer in `text` (None when there is none)."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()
        self._guesses_left = 0

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        high: int = 100,
        max_guesses: int = 7,
        **kwargs: Any,
    ) -> GuessObservation:
        if not 1 <= high <= MAX_HIGH or max_guesses < 1:
            raise ValueError(f"need 1 <= high <= {MAX_HIGH} and max_guesses >= 1, got {high}, {max_guesses}")
        secret = random.Random(seed).randint(1, high)
        self._state = GuessState(
            episode_id=episode_id or str(uuid.uuid4()), secret=secret, high=high, max_guesses=max_guesses
        )
        self._guesses_left = max_guesses
        prompt = (
            f"I am thinking of an integer between 1 and {high}. You have {max_guesses} guesses; after each I say "
            "higher, lower or correct. Reply with your guess: just the number."
        )
        return GuessObservation(prompt=prompt, guesses_left=max_guesses, done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if self._guesses_left <= 0:
            raise RuntimeError("the episode is over: reset first")
        self._state.step_count += 1
        self._guesses_left -= 1
        guess = read_guess(action.guess)
        left = self._guesses_left
        if guess == self._state.secret:
            self._state.solved = True
            return GuessObservation(prompt="Correct!", guesses_left=left, last_guess=guess, done=True, reward=1.0)
        feedback = "That is not a number." if guess is None else "Higher." if guess < self._state.secret else "Lower."
        done = left == 0
        feedback += f" No guesses left: it was {self._state.secret}." if done else f" {left} guesses left."
        return GuessObservation(prompt=feedback, guesses_left=left, last_guess=guess, done=done, reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="guess_number",
            description="Guess an integer in [1, high] from higher/lower feedback; 1.0 for the right guess.",
            version="0.1.0",
        )
