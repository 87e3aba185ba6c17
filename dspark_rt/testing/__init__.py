"""Test and benchmark support, never imported by the serving path: tiny checkpoints in the real
formats (fixtures), the op test cases shared by tests and kernel benchmarks (op_cases), the
timing helper (bench), random-weight models of real shapes (random_models) and benchmark-only
rounds (synthetic acceptance, phase timers: rounds)."""
from .fixtures import *  # noqa: F401,F403  (the tiny-checkpoint writers, as dspark_rt.testing.*)
from .fixtures import __all__
