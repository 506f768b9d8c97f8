"""miles CLI: the `miles` command (typer + rich) and the local platform behind `miles up` / `miles down`.

A client of the controller's REST API, and the launcher and keeper of the shared services on one machine. It is
not a service: it serves nothing and owns no job state (the controller does).
"""
