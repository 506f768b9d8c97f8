"""miles rollout-worker: running user agents and reward functions, turning episodes into scored groups, the job's
dataset cursor (Redis), and pushing groups to the buffer.
"""
