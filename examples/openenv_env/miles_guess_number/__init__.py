"""miles-guess-number: an OpenEnv environment (openenv-core 0.3.0) in the layout `openenv init` writes.

The environment thinks of an integer in [1, high]; each step is one guess, answered "higher", "lower" or
"correct". Reward 1.0 for the step that guesses it, 0.0 for the others; the episode ends at the right guess or
after `max_guesses`. Served by `uvicorn miles_guess_number.server.app:app` (what miles' openenv connector starts);
any OpenEnv client drives it over /ws (reset, then step with `{"guess": "<text with a number>"}`).
"""

from miles_guess_number.models import GuessAction, GuessObservation, GuessState

__all__ = ["GuessAction", "GuessObservation", "GuessState"]
