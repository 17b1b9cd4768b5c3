"""Benchmarks of the hot paths (``python -m tools.bench``; ``docs/benchmarks.md``).

One module per benchmark, each with ``run(smoke: bool = False, **options) -> dict`` returning a
:func:`tools.bench.common.make_result` record; :mod:`tools.bench.__main__` runs them (each in its own
process by default), prints one table and writes one JSON file.
"""

BENCHMARKS = ("logprobs", "update_step", "rollout", "long_tail", "long_tail_run", "packing", "routing", "r3_cost",
              "zero_mismatch",
              "reward", "rl_step", "overlap", "checkpoint", "trl_peer", "scaling", "gpu_qwen3_slice")
"""Run order; ``gpu_qwen3_slice`` reports "not run" without CUDA."""
