"""Job backends: what creates, watches, resizes and removes one job's per-job resources.

`base` holds the interface (`JobBackend`) and the data it exchanges with the controller; `local` runs the per-job
processes on this machine, `kubernetes` creates the per-job objects from the chart's job templates. The
controller picks one with `make_backend` in `miles.controller.main` (from `settings.backend`) and imports only
that one.
"""
