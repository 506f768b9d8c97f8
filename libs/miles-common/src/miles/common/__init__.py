"""Shared library of the miles services (settings, errors, telemetry, HTTP and gRPC helpers).

Everything here is framework glue that every service needs in the same shape; service logic never lives here.
Heavy imports (FastAPI, grpc) happen in the submodules that need them, so `import miles.common` stays cheap.

gRPC's fork support is turned off for every process that imports this package (unless the environment says
otherwise): with it on, gRPC's pthread_atfork handler runs inside every fork() and can deadlock the forking thread
(seen in CI: a test's `subprocess.Popen` of a service hung for 10 minutes in that handler, in a process that had
used gRPC channels). Our processes only fork to exec a child (subprocess), which needs no handler: gRPC documents
GRPC_ENABLE_FORK_SUPPORT=false for exactly that case. It must be set before gRPC initialises (its first channel
or server), which importing miles.common first guarantees for every service.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__: list[str] = []
