"""miles-vf-arith: a verifiers (0.4.0) environment, loaded by id `miles-vf-arith` (`--env.taskset.id`).

Exports the taskset and its environment, which verifiers pairs by default (`vf.environment_class`).
"""

from miles_vf_arith.env import ArithRetryEnv, ArithRetryEnvConfig
from miles_vf_arith.taskset import ArithConfig, ArithTaskset

__all__ = ["ArithConfig", "ArithRetryEnv", "ArithRetryEnvConfig", "ArithTaskset"]
