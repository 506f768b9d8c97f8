"""The environment's action, observation and state: OpenEnv's pydantic types (validated by its server)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """One guess: free text whose last integer is the guess (a model's reply can be passed as it is)."""

    guess: str = Field(..., description="Text whose last integer is the guess, e.g. '50' or 'I guess 50.'")


class GuessObservation(Observation):
    """What the player sees: `prompt` is the text for the model (the task, then the feedback on each guess)."""

    prompt: str = Field(default="", description="The task or the feedback on the last guess")
    guesses_left: int = Field(default=0, ge=0, description="Guesses the player still has")
    last_guess: int | None = Field(default=None, description="The integer read from the last guess, if any")


class GuessState(State):
    """The episode's hidden state (OpenEnv's /ws `state` message returns it)."""

    secret: int = Field(default=0, description="The number to guess")
    high: int = Field(default=100, ge=1, description="The secret is in [1, high]")
    max_guesses: int = Field(default=7, ge=1, description="Guesses allowed")
    solved: bool = Field(default=False)
