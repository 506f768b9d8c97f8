"""Contracts between miles services that the protos cannot state: one meaning, one implementation, every side.

- `weight_version`: SGLang's weight_version label as a miles version (what "default" means, what is unknown).
- `samples`: the invariants of a `miles.common.v1.Sample` (one check, run by the session server that builds
  samples, the buffer that stores them and the trainer that consumes them) and the sample status sets.
- `headers`: the HTTP header names one service sends and another reads (pool, routing key, minimum version).
- `engine_control`: the pause modes of an engine's weight update (engine, weight-sync, trainer).

Not here: bearer tokens, the loopback rule and the refuse-to-start token check live in `miles.common.auth`;
picking free ports in `miles.common.ports`; the weights digest in `miles.common.weights`. Each module is small and
imports nothing heavier than the generated protos, so a service's framework-free core can use it.
"""

__all__: list[str] = []
