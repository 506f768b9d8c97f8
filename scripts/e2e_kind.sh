#!/usr/bin/env bash
# `make e2e-kind`: the platform on a local kind cluster, end to end, on the CPU (not run in CI: it needs docker and
# kind). Builds every service image, loads them into a one-node kind cluster, applies k8s/overlays/kind (the chart
# inflated by kustomize with the CPU engine and the tiny model), waits for the shared services, submits a demo job
# (examples/calculator_tool's rollout section on the tiny model) to the controller and waits until its trainer has
# taken STEPS optimizer steps and the engines serve its new versions. Then, mid-job, it resizes the engines 1 -> 2
# -> 1 through PATCH /v1/jobs/{id} while probing the job's router pool (every response must come from an engine at
# or past the pool's version before the resize: the joining engine gets no traffic until weight-sync caught it up),
# cancels the job and checks that its router pool is gone. The cluster is deleted at the end unless KEEP_CLUSTER=1.
#
# Environment: CLUSTER (kind cluster name, default miles-e2e), STEPS (default 2), TIMEOUT_S (per wait, default
# 900), KEEP_CLUSTER=1 (leave the cluster running for a look around), SKIP_BUILD=1 (images already loaded),
# RESIZE=0 (skip the resize and cancel steps).
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-miles-e2e}
STEPS=${STEPS:-2}
TIMEOUT_S=${TIMEOUT_S:-900}
TAG=0.1.0
NAMESPACE=miles
SERVICES=(controller session-server rollout-router buffer sandbox-gateway engine rollout-worker trainer weight-sync)
PY=.venv/bin/python
KUBECTL=$(command -v .tools/bin/kubectl || command -v kubectl || true)
HELM=$(command -v .tools/bin/helm || command -v helm || true)

die() { echo "e2e-kind: $*" >&2; exit 1; }
for tool in kind docker; do command -v "$tool" >/dev/null || die "$tool is required (https://kind.sigs.k8s.io)"; done
[[ -n $KUBECTL && -n $HELM ]] || die "kubectl and helm are required: run make setup"
[[ -x $PY ]] || die ".venv is missing: run make setup"
HELM=$(realpath "$HELM")

cleanup() {
  [[ -n ${PORT_FORWARD_PID:-} ]] && kill "$PORT_FORWARD_PID" 2>/dev/null || true
  if [[ ${KEEP_CLUSTER:-0} != 1 ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

echo "== tiny model (.miles/models/tiny-qwen3)"
make --no-print-directory tiny-model TINY_MODEL_DIR=.miles/models/tiny-qwen3

echo "== kind cluster $CLUSTER"
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  config=$(mktemp)
  sed "s#hostPath: .miles/models#hostPath: $PWD/.miles/models#" k8s/overlays/kind/kind-cluster.yaml >"$config"
  kind create cluster --name "$CLUSTER" --config "$config" --wait 120s
  rm -f "$config"
fi
"$KUBECTL" config use-context "kind-$CLUSTER" >/dev/null

if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  for service in "${SERVICES[@]}"; do
    echo "== image miles-$service:$TAG"
    docker build -q -f Dockerfile --build-arg SERVICE="$service" -t "miles-$service:$TAG" .
    kind load docker-image --name "$CLUSTER" "miles-$service:$TAG"
  done
fi

echo "== apply k8s/overlays/kind"
"$KUBECTL" kustomize --enable-helm --helm-command "$HELM" --load-restrictor LoadRestrictionsNone k8s/overlays/kind \
  | "$KUBECTL" apply --server-side --force-conflicts -f -
"$KUBECTL" -n "$NAMESPACE" rollout status statefulset/miles-redis --timeout "${TIMEOUT_S}s"
for deployment in controller session-server rollout-router buffer sandbox-gateway; do
  "$KUBECTL" -n "$NAMESPACE" rollout status "deployment/miles-$deployment" --timeout "${TIMEOUT_S}s"
done

echo "== submit the demo job"
TOKEN=$("$KUBECTL" -n "$NAMESPACE" get secret miles-auth -o jsonpath='{.data.controller-api-tokens}' | base64 -d | cut -d, -f1)
PORT=$($PY -c "from miles.common.testing import free_port; print(free_port())")
"$KUBECTL" -n "$NAMESPACE" port-forward svc/miles-controller "$PORT:8080" >/dev/null 2>&1 &
PORT_FORWARD_PID=$!
URL=http://127.0.0.1:$PORT
for _ in $(seq 60); do curl -fsS "$URL/healthz" >/dev/null 2>&1 && break; sleep 1; done
SPEC=$($PY - "$STEPS" <<'EOF'
import json, sys, yaml
rollout = yaml.safe_load(open("examples/calculator_tool/job.yaml"))["rollout"]
spec = {
    "name": "kind-demo",
    "model": {"path": "/models/tiny-qwen3", "family": "qwen3"},
    "rollout": rollout,
    "train": {"num_steps": int(sys.argv[1]) + 1000},  # still running for the resize; cancelled at the end
    "resources": {"engines": {"replicas": 1, "kind": "cpu"}, "rollout_workers": {"replicas": 1}, "trainer": {"replicas": 1}},
}
print(json.dumps(spec))
EOF
)
JOB_ID=$(curl -fsS -X POST "$URL/v1/jobs" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
  -d "$SPEC" | $PY -c "import json, sys; print(json.load(sys.stdin)['job_id'])")
echo "job $JOB_ID"

echo "== wait for $STEPS steps"
deadline=$((SECONDS + TIMEOUT_S))
while :; do
  view=$(curl -fsS "$URL/v1/jobs/$JOB_ID" -H "Authorization: Bearer $TOKEN")
  read -r state step < <($PY -c "import json, sys; v = json.load(sys.stdin); print(v['state'], v['step'])" <<<"$view")
  echo "state=$state step=$step"
  [[ $state == FAILED || $state == CANCELLED ]] && { echo "$view"; "$KUBECTL" -n "$NAMESPACE" get pods -o wide; die "job $state"; }
  ((step >= STEPS)) && break
  ((SECONDS < deadline)) || { "$KUBECTL" -n "$NAMESPACE" get pods -o wide; die "no $STEPS steps in ${TIMEOUT_S}s"; }
  sleep 10
done
"$KUBECTL" -n "$NAMESPACE" get pods -l "miles.dev/job=$JOB_ID" -o wide

echo "== the engines follow the trainer's versions (trainer -> weight-sync origin -> engines)"
ROUTER_PORT=$($PY -c "from miles.common.testing import free_port; print(free_port())")
"$KUBECTL" -n "$NAMESPACE" port-forward svc/miles-rollout-router "$ROUTER_PORT:8082" >/dev/null 2>&1 &
ROUTER_FORWARD_PID=$!
for _ in $(seq 60); do curl -fsS "http://127.0.0.1:$ROUTER_PORT/healthz" >/dev/null 2>&1 && break; sleep 1; done
deadline=$((SECONDS + TIMEOUT_S))
while :; do
  trainer_version=$(curl -fsS "$URL/v1/jobs/$JOB_ID" -H "Authorization: Bearer $TOKEN" \
    | $PY -c "import json, sys; print(json.load(sys.stdin)['weight_version'])")
  engines=$(curl -fsS "http://127.0.0.1:$ROUTER_PORT/admin/v1/engines?pool=$JOB_ID")
  # Every engine of the job's pool serves a version the trainer published after its initial weights, at most 2
  # behind the trainer's (rollouts run while the trainer keeps stepping).
  if $PY -c '
import json, sys
trainer = int(sys.argv[1])
versions = [int(e["weight_version"]) for e in json.loads(sys.argv[2])["engines"]]
print(f"trainer version {trainer}, engines {versions}")
sys.exit(0 if versions and all(1 <= v <= trainer and trainer - v <= 2 for v in versions) else 1)
' "$trainer_version" "$engines"; then break; fi
  ((SECONDS < deadline)) || die "the engines did not follow the trainer's versions in ${TIMEOUT_S}s"
  sleep 5
done
ROUTER=http://127.0.0.1:$ROUTER_PORT
pool_engines() { curl -fsS "$ROUTER/admin/v1/engines?pool=$JOB_ID"; }
resize_engines() {
  curl -fsS -X PATCH "$URL/v1/jobs/$JOB_ID" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -d "{\"engines\": $1}" >/dev/null
}
wait_for_pool() {  # until the pool has $1 engines, all healthy
  local deadline=$((SECONDS + TIMEOUT_S))
  until pool_engines | $PY -c '
import json, sys
engines = json.load(sys.stdin)["engines"]
sys.exit(0 if len(engines) == int(sys.argv[1]) and all(e["state"] == "healthy" for e in engines) else 1)
' "$1"; do
    ((SECONDS < deadline)) || { pool_engines; die "the pool did not reach $1 healthy engines in ${TIMEOUT_S}s"; }
    sleep 3
  done
}
probe() {  # $2 generate requests through the job's pool: each one 200 (or a retryable 503) and at version >= $1
  $PY - "$ROUTER" "$JOB_ID" "$1" "$2" <<'EOF'
import sys, httpx
router, pool, floor, num = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
served, behind = 0, []
for _ in range(num):
    response = httpx.post(f"{router}/generate", json=body, headers={"X-Miles-Pool": pool}, timeout=60)
    if response.status_code == 503 and "no_routable_engine" in response.text:
        continue
    response.raise_for_status()
    version = int(response.json()["meta_info"]["weight_version"])
    served += 1
    if version < floor:
        behind.append(version)
print(f"probe: {served} of {num} served, {len(behind)} behind version {floor}")
sys.exit(1 if behind or served == 0 else 0)
EOF
}
if [[ ${RESIZE:-1} == 1 ]]; then
  echo "== resize the engines 1 -> 2 -> 1 mid-job"
  floor=$(curl -fsS "$ROUTER/v1/weight_version?pool=$JOB_ID" \
    | $PY -c "import json, sys; print(json.load(sys.stdin)['min_weight_version'])")
  resize_engines 2
  probe "$floor" 50 || die "a response was served behind version $floor while an engine joined"
  wait_for_pool 2
  probe "$floor" 50 || die "a response was served behind version $floor with 2 engines"
  resize_engines 1
  wait_for_pool 1
  probe "$floor" 20 || die "the pool failed after the engine was removed"
  echo "== cancel the job: its router pool goes with it"
  curl -fsS -X POST "$URL/v1/jobs/$JOB_ID/cancel" -H "Authorization: Bearer $TOKEN" >/dev/null
  deadline=$((SECONDS + TIMEOUT_S))
  until [[ $(curl -s -o /dev/null -w '%{http_code}' "$ROUTER/admin/v1/engines?pool=$JOB_ID") == 404 ]]; do
    ((SECONDS < deadline)) || die "the job's router pool was left behind"
    sleep 5
  done
fi
kill "$ROUTER_FORWARD_PID" 2>/dev/null || true
echo "e2e-kind: OK (job $JOB_ID took $step steps; the engines serve the trainer's new versions; RESIZE=${RESIZE:-1})"
