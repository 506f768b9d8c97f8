"""The FastAPI app: OpenEnv's `create_app` around the environment (/ws sessions, /reset, /step, /health, /schema).

    uvicorn miles_guess_number.server.app:app --host 127.0.0.1 --port 8000

MILES_GUESS_NUMBER_MAX_SESSIONS (default 8) is the number of concurrent /ws sessions (one environment each);
a session past it is refused with OpenEnv's CAPACITY_REACHED error.
"""

from __future__ import annotations

import os

from openenv.core.env_server.http_server import create_app

from miles_guess_number.models import GuessAction, GuessObservation
from miles_guess_number.server.guess_number_environment import GuessNumberEnvironment

app = create_app(
    GuessNumberEnvironment,
    GuessAction,
    GuessObservation,
    env_name="miles_guess_number",
    max_concurrent_envs=int(os.environ.get("MILES_GUESS_NUMBER_MAX_SESSIONS", "8")),
)
