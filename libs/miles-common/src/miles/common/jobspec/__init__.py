"""The job spec: what a user submits to the controller (`POST /v1/jobs`), as typed pydantic models.

It lives in the shared library because three parties read it without depending on each other: the
controller validates a whole spec at submit time (422 with the field path), and each per-job process
(rollout worker, trainer, weight-sync) receives its own section as a JSON config file
(`MILES_<SERVICE>_CONFIG_FILE`) and validates it again with the same model at start-up. No torch here.

One module per section: `rollout` (dataset, agent, reward, groups, concurrency), `trainer` (algorithm and
its hyper-parameters), and the top-level `JobSpec` that composes them.
"""
