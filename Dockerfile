# syntax=docker/dockerfile:1
# One image per service, all from this file, built from the repository root:
#   docker build --build-arg SERVICE=buffer -t miles-buffer .
# SERVICE is a directory under services/; the image installs that service, the libraries and the other miles
# packages its pyproject.toml depends on (read at build time, transitively), and runs its console script
# miles-$SERVICE as uid 10001. Arguments (`docker run IMAGE --flag`, a pod's `args:`) go to that script.
# Without --build-arg SERVICE=..., the build stops at `FROM svc-${SERVICE}`, naming this default.
# The environment servers' images (one per hub connector) are the targets envserver-<name>, further down.
ARG SERVICE=required-build-arg-service
ARG PYTHON_IMAGE=python:3.11-slim
# The environment servers whose lock asks for another Python (first line `# python: 3.12`) build on this image.
ARG PYTHON_3_12_IMAGE=python:3.12-slim

# Stage 1 generates the protobuf code (gitignored in the repo) into libs/miles-common, once for every service.
FROM ${PYTHON_IMAGE} AS protos
WORKDIR /src
COPY requirements/constraints.txt requirements/constraints.txt
RUN pip install --no-cache-dir -c requirements/constraints.txt grpcio-tools
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY protos protos
COPY libs/miles-common libs/miles-common
RUN python scripts/gen_protos.py

# Stage 2 builds wheels of SERVICE and of the miles packages it needs: the `miles-*` names among the
# [project].dependencies of its pyproject.toml, and theirs, resolved to libs/* and services/* by project name.
FROM protos AS wheels
ARG SERVICE
COPY libs libs
COPY services services
RUN test -n "$SERVICE" -a -f "services/$SERVICE/pyproject.toml" \
    || { echo "--build-arg SERVICE=<a directory of services/> is required (got '$SERVICE')" >&2; exit 1; }
RUN python - "$SERVICE" > /tmp/packages <<'PY'
import pathlib, sys, tomllib

def project(directory):
    return tomllib.loads((directory / "pyproject.toml").read_text())["project"]

directories = [path.parent for path in sorted(pathlib.Path().glob("*/*/pyproject.toml"))]
by_name = {project(directory)["name"]: directory for directory in directories}
todo, needed = [pathlib.Path("services", sys.argv[1])], set()
while todo:
    directory = todo.pop()
    if directory not in needed:
        needed.add(directory)
        names = (dep.split(";")[0].split("==")[0].split("[")[0].strip() for dep in project(directory).get("dependencies", []))
        todo += [by_name[name] for name in names if name in by_name]
print("\n".join(sorted(map(str, needed))))
PY
RUN echo "miles-$SERVICE: $(tr '\n' ' ' < /tmp/packages)" \
    && pip wheel --no-cache-dir --no-deps -w /wheels $(cat /tmp/packages)

# Stage 3: the runtime every service shares, an unprivileged user and nothing of the build.
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin miles

# Stage 4: what differs between services (system packages, files, the env that binds the service to every
# interface: its settings prefix is not always the directory name, and the ports it listens on). One stage per
# directory of services/, named svc-<directory>; the final stage starts from svc-$SERVICE.
FROM runtime AS svc-buffer
ENV MILES_BUFFER_HOST=0.0.0.0
EXPOSE 50051 51051

FROM runtime AS svc-controller
ENV MILES_CONTROLLER_HOST=0.0.0.0
EXPOSE 8080

FROM runtime AS svc-engine
ENV MILES_ENGINE_HOST=0.0.0.0
EXPOSE 30000

FROM runtime AS svc-rollout-router
ENV MILES_ROUTER_HOST=0.0.0.0
EXPOSE 8082 8083

# The example tasks are copied to /opt/miles/examples so that their job specs (paths relative to /opt/miles) run as
# they are; a job's own agent code comes in an image built FROM this one, or a volume named in
# `rollout.agent.python_path`. The buffer's client library (miles-buffer) is installed from the dependencies.
FROM runtime AS svc-rollout-worker
COPY examples /opt/miles/examples
WORKDIR /opt/miles
ENV MILES_ROLLOUT_HOST=0.0.0.0
EXPOSE 8083

# The local backend needs bubblewrap (--seccomp; bookworm's 0.8.0 also has --disable-userns) and util-linux's
# setpriv; each exec starts through the gateway's own python (local/enter.py). As a non-root user it runs in
# "userns" mode, which needs unprivileged user namespaces in the container (a seccomp/AppArmor profile that
# allows unshare(CLONE_NEWUSER)); without them the gateway refuses to start with backend=local. In production
# set MILES_SANDBOX_BACKEND=kubernetes (see the README: the Kubernetes backend is the production choice).
# HOST=0.0.0.0: the gateway refuses to start without MILES_SANDBOX_OPERATOR_TOKEN (32+ characters).
# state_dir holds the local sandboxes' work dirs: mount a size-limited volume here (e.g. an emptyDir sizeLimit).
FROM runtime AS svc-sandbox-gateway
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap util-linux \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/miles-sandbox \
    && chown miles:miles /var/lib/miles-sandbox
ENV MILES_SANDBOX_HOST=0.0.0.0 MILES_SANDBOX_STATE_DIR=/var/lib/miles-sandbox
VOLUME /var/lib/miles-sandbox
EXPOSE 50054 51054

FROM runtime AS svc-session-server
ENV MILES_SESSION_HOST=0.0.0.0
EXPOSE 8081

# The trainer pulls from the buffer and publishes to weight-sync with their client libraries (miles.buffer.client,
# miles.weightsync.client; nccl: miles.weightsync.nccl): the packages are installed, their services run elsewhere.
FROM runtime AS svc-trainer
ENV MILES_TRAINER_HOST=0.0.0.0
EXPOSE 50052 51052

FROM runtime AS svc-weight-sync
ENV MILES_WEIGHTSYNC_HOST=0.0.0.0
EXPOSE 50053 51053

# Environment servers (libs/miles-envserver): one image per hub connector, not a service. Each holds the connector's
# own interpreter, built by scripts/make_env.py from the full lock requirements/envs/<name>.txt (pins that conflict
# with the services', e.g. verifiers' openai<3 or Harbor's Python 3.12, so never in a service image), at
# /opt/miles/.envs/<name>, first on PATH: `python` is the environment's. Built by target, from the repository root:
#   docker build --target envserver-reasoning-gym -t miles-envserver-reasoning-gym .
# The chart runs `python -m miles.envserver --connector ... --args ...` in it (jobTemplates.envServer.images);
# `docker run IMAGE --connector reasoning_gym --args '{...}' --host 0.0.0.0 --port 8090` does the same.
# A stage per Python version the locks ask for (their first line `# python: X.Y`; none: PYTHON_IMAGE's 3.11).
FROM runtime AS envserver-python-3.11
WORKDIR /opt/miles
COPY scripts/make_env.py scripts/make_env.py
COPY libs/miles-envserver libs/miles-envserver

FROM ${PYTHON_3_12_IMAGE} AS envserver-python-3.12
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin miles
WORKDIR /opt/miles
COPY scripts/make_env.py scripts/make_env.py
COPY libs/miles-envserver libs/miles-envserver

# One target per lock: envserver-<name> FROM envserver-python-<its Python> (tests/test_workspace_layout.py checks).
FROM envserver-python-3.11 AS envserver-reasoning-gym
COPY requirements/envs/reasoning-gym.txt requirements/envs/reasoning-gym.txt
RUN python scripts/make_env.py reasoning-gym
ENV PATH=/opt/miles/.envs/reasoning-gym/bin:$PATH
USER 10001
ENTRYPOINT ["python", "-m", "miles.envserver"]

# The example environments of requirements/envs/<name>.local are installed too (examples/*/job.yaml run as they are).
FROM envserver-python-3.11 AS envserver-verifiers
COPY requirements/envs/verifiers.txt requirements/envs/verifiers.local requirements/envs/
COPY examples/verifiers_env examples/verifiers_env
RUN python scripts/make_env.py verifiers
ENV PATH=/opt/miles/.envs/verifiers/bin:$PATH
USER 10001
ENTRYPOINT ["python", "-m", "miles.envserver"]

FROM envserver-python-3.11 AS envserver-openenv
COPY requirements/envs/openenv.txt requirements/envs/openenv.local requirements/envs/
COPY examples/openenv_env examples/openenv_env
RUN python scripts/make_env.py openenv
ENV PATH=/opt/miles/.envs/openenv/bin:$PATH
USER 10001
ENTRYPOINT ["python", "-m", "miles.envserver"]

# The example Harbor tasks (tasks_dir: examples/harbor_tasks); mount your own (jobTemplates.envServer.extraVolumes).
FROM envserver-python-3.12 AS envserver-harbor
COPY requirements/envs/harbor.txt requirements/envs/harbor.txt
COPY examples/harbor_tasks examples/harbor_tasks
RUN python scripts/make_env.py harbor
ENV PATH=/opt/miles/.envs/harbor/bin:$PATH
USER 10001
ENTRYPOINT ["python", "-m", "miles.envserver"]

# Stage 5: the service's wheels installed (pinned by the constraints) on its stage, run as the unprivileged user.
FROM svc-${SERVICE}
ARG SERVICE
COPY requirements/constraints.txt /tmp/constraints.txt
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir -c /tmp/constraints.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/constraints.txt \
    && command -v "miles-$SERVICE" >/dev/null
USER 10001
ENV MILES_IMAGE_SERVICE=${SERVICE}
ENTRYPOINT ["/bin/sh", "-c", "exec \"miles-$MILES_IMAGE_SERVICE\" \"$@\"", "miles"]
