"""Shared library of the miles services (settings, errors, telemetry, HTTP and gRPC helpers).

Everything here is framework glue that every service needs in the same shape; service logic never lives here.
Heavy imports (FastAPI, grpc) happen in the submodules that need them, so `import miles.common` stays cheap.
"""

__all__: list[str] = []
