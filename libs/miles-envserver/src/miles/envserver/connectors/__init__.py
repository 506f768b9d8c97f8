"""One module per connector; each has `create(args: dict) -> Environment` (see `miles.envserver.base`)."""
