"""miles buffer: trajectory groups of every job in Redis: idempotent pushes, leased pulls within a staleness bound,
acks, and buffer statistics.
"""
