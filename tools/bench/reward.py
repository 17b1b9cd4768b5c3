"""Benchmark 8: the reward stage (``gspo_megatron.rewards``), 128 responses, side by side.

    python -m tools.bench.reward [--n 128] [--rounds 7]

* exact match (``arithmetic_exact``, registered cheap): inline (today's path) vs a thread per
  call (the path every reward took before: what ``reward/`` cost per step) vs 2 worker processes.
* math-verify (``math_verify``, CPU-bound parsing): a thread per call in the trainer (``reward.
  num_workers: 0``) vs 1 and 2 worker processes. With 2 cores the 2-worker pool should approach
  half the 1-worker time; threads share the GIL.

Targets (issue 16): exact match at most 10 ms per 128; math-verify scales across 2 workers.
Workers are started (and have resolved the reward) before timing: the pool lives for the run.
"""

from __future__ import annotations

# Answers and responses of the shapes math-verify sees in DAPO-Math-style data.
_MATH = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
         (r"\boxed{x^2+2x+1}", "(x+1)^2"), (r"\boxed{\pi/4}", r"\frac{\pi}{4}"),
         (r"\boxed{17}", "18"), (r"\boxed{(1,2]}", r"(1, 2]"), (r"\boxed{3.14}", r"\pi"),
         (r"\boxed{\dfrac{3}{4}}", "0.75")]


def run(smoke: bool = False, n: int = 128, rounds: int = 7) -> dict:
    from gspo_megatron.rewards import compute_rewards, get_reward_fn
    from gspo_megatron.rewards.math import arithmetic_exact
    from gspo_megatron.rewards.workers import RewardWorkers
    from tools.bench.common import interleaved, make_result, median, median_ratio, row

    if smoke:
        n, rounds = 8, 1
    rows, ratios = [], {}
    exact_in = ([f"{i % 40}" for i in range(n)], [f"{(i * 7) % 40}" for i in range(n)])

    def not_cheap(response, answer, example=None):  # the same function, without the cheap mark
        return arithmetic_exact(response, answer, example)

    with RewardWorkers("arithmetic_exact", 2, timeout_s=5) as pool:
        times = interleaved({
            "inline": lambda: compute_rewards(arithmetic_exact, *exact_in, timeout_s=5),
            "thread_per_call": lambda: compute_rewards(not_cheap, *exact_in, timeout_s=5),
            "workers_2": lambda: compute_rewards(not_cheap, *exact_in, timeout_s=5, workers=pool),
        }, rounds)
    for name, label in (("inline", "inline (cheap rewards: the default path)"),
                        ("thread_per_call", "a thread per call (before)"),
                        ("workers_2", "2 worker processes")):
        rows.append(row(f"exact match x{n}: {label}", median(times[name]) * 1e3, "ms"))
    ratios["exact_inline_vs_threads"] = median_ratio(times, "inline", "thread_per_call")
    exact_ms = median(times["inline"]) * 1e3

    math_ok = True
    try:
        fn = get_reward_fn("math_verify")
    except ImportError:
        math_ok = False
    scale = None
    if math_ok:
        pairs = [_MATH[i % len(_MATH)] for i in range(n)]
        math_in = ([p[0] for p in pairs], [p[1] for p in pairs])
        with RewardWorkers("math_verify", 1, timeout_s=30) as one, \
                RewardWorkers("math_verify", 2, timeout_s=30) as two:
            want, _ = compute_rewards(fn, *math_in, timeout_s=30, workers=one)
            got, _ = compute_rewards(fn, *math_in, timeout_s=30, workers=two)
            threads, _ = compute_rewards(fn, *math_in, timeout_s=30)
            assert want.tolist() == got.tolist() == threads.tolist(), "paths disagree"
            times = interleaved({
                "threads": lambda: compute_rewards(fn, *math_in, timeout_s=30),
                "workers_1": lambda: compute_rewards(fn, *math_in, timeout_s=30, workers=one),
                "workers_2": lambda: compute_rewards(fn, *math_in, timeout_s=30, workers=two),
            }, max(1, rounds // 2))
        for name, label in (("threads", "a thread per call in the trainer"),
                            ("workers_1", "1 worker process"), ("workers_2", "2 worker processes")):
            rows.append(row(f"math-verify x{n}: {label}", median(times[name]) * 1e3, "ms"))
        scale = median_ratio(times, "workers_1", "workers_2")
        ratios["math_verify_1_vs_2_workers"] = scale
        ratios["math_verify_threads_vs_2_workers"] = median_ratio(times, "threads", "workers_2")
    else:
        rows.append(row("math-verify", "not installed (pip install math-verify)", ""))
    return make_result(
        "reward", f"Reward stage, {n} responses", "exact match <= 10 ms per 128; math-verify "
        "faster with 2 workers than 1", None if smoke else bool(exact_ms <= 10 * n / 128
                                                              and (scale is None or scale > 1.0)),
        rows, ratios, config={"n": n, "rounds": rounds},
        notes=["workers started before timing (the pool lives for the whole run)"])


def _args(ap) -> None:
    ap.add_argument("--n", type=int)
    ap.add_argument("--rounds", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
