"""miles sandbox-gateway: isolated execution for agent tools — local bubblewrap sandboxes, Kubernetes pods and
remote providers behind one API (gRPC and an HTTP facade), with limits, TTLs, per-job quotas and a warm pool.

Map: `core.py` (the core), `backend.py` (backend interface and the threat model: what each backend does
not protect against), `local/` (bubblewrap), `kubernetes_backend.py` + `kube_manifests.py`, `remote_backend.py`,
`validation.py`, `grpc_api.py` / `http_api.py` (transports), `main.py`.
"""
