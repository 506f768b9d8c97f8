"""miles rollout-router: the engine registry of every pool, engine health and weight versions, the prefix/affinity
index, and forwarding SGLang-native requests to one engine.
"""
