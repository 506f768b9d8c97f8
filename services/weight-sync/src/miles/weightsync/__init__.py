"""miles weight-sync: the versioned weight store of a job (full snapshots and lossless deltas) and rolling,
version-locked updates of the job's engines.
"""
