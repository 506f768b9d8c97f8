"""`python -m miles.envserver --connector NAME --args JSON [--host H] [--port P] [--port-file F]`.

NAME is a built-in connector (`reasoning_gym`, `verifiers`, `openenv`, `harbor`) or the dotted path of a module
with `create(args) -> Environment` (a user's own environment). The server listens first (port 0 = any free
port, written to --port-file once listening), then runs the environment's setup: /healthz answers 503 until it
is done, 200 after. Exit 2: bad arguments or connector args; exit 1: setup failed (the message on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from miles.envserver.base import ConnectorArgsError, Environment
from miles.envserver.server import EnvironmentServer

log = logging.getLogger("miles.envserver")
BUILT_IN = ("reasoning_gym", "verifiers", "openenv", "harbor")


def load_environment(connector: str, args: dict[str, object]) -> Environment:
    module_name = f"miles.envserver.connectors.{connector}" if connector in BUILT_IN else connector
    module = importlib.import_module(module_name)
    environment: Environment = module.create(args)
    if not environment.connector:
        environment.connector = connector
    return environment


async def serve(environment: Environment, host: str, port: int, port_file: Path | None) -> None:
    server = EnvironmentServer(environment)
    listener = await asyncio.start_server(server.handle, host, port)
    bound = listener.sockets[0].getsockname()[1]
    if port_file is not None:
        partial = port_file.with_suffix(".tmp")
        partial.write_text(str(bound))
        os.replace(partial, port_file)  # readers never see half a number
    log.info("environment server listening", extra={"port": bound, "connector": environment.connector})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with listener:
        await server.setup()
        log.info("environment ready: %s (%d rows)", environment.name, len(environment.rows()))
        await stop.wait()
    await environment.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles.envserver", description=__doc__.splitlines()[0])
    parser.add_argument("--connector", required=True)
    parser.add_argument("--args", default="{}", help="the connector's arguments as a JSON object")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        args = json.loads(options.args)
        if not isinstance(args, dict):
            raise ValueError("--args must be a JSON object")
        environment = load_environment(options.connector, args)
    except (ValueError, ConnectorArgsError, ImportError) as exc:
        print(f"environment server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(environment, options.host, options.port, options.port_file))
    except Exception as exc:  # setup failed: the worker restarts the server (with backoff) and shows this line
        print(f"environment server: setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
