"""miles controller: jobs: the REST job API (`/v1/jobs`), job state in Redis, the local and Kubernetes launchers
that create each job's per-job resources, and the `miles` CLI.
"""
