"""Benchmarks (docs/benchmarks.md; figures in RESULTS.md)."""

import os

# Benchmarks time engines at full speed: every step executable compiled before the engine serves, in this process
# and in the servers it starts (benchmarks.startup times background compilation itself, passing the flag).
os.environ.setdefault("PAGED_JAX_BACKGROUND_COMPILATION", "0")
