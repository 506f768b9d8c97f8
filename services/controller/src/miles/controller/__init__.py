"""miles controller: jobs: the REST job API (`/v1/jobs`), job state in Redis, and the local and Kubernetes
launchers that create each job's per-job resources. The `miles` CLI and `miles up` are the miles-cli package.
"""
