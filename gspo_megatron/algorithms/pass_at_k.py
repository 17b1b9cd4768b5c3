"""pass@k and mean@k from n sampled answers per problem (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code", arXiv 2107.03374, Sec. 2.1).

With ``n`` samples of which ``c`` are correct, the unbiased estimator of the chance that at least
one of ``k <= n`` samples is correct is::

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as the product ``prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials). ``mean@n``
is the mean correctness of all samples (= pass@1). Pure Python / torch.
"""

from __future__ import annotations

import torch

__all__ = ["pass_at_k", "pass_at_k_ladder", "sampled_eval_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (``1 <= k <= n``)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_ladder(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sampled_eval_metrics(correct: torch.Tensor, n: int) -> torch.Tensor:
    """Sums over problems, for a data-parallel all-reduce: ``correct`` ``[P]`` holds each problem's
    correct count among its ``n`` samples. Returns float64 ``[2 + len(ladder)]``: the number of
    problems, the summed mean correctness (``c / n``), then the summed pass@k for each k of
    :func:`pass_at_k_ladder`. Divide by the first entry after reducing."""
    counts = [int(c) for c in correct.tolist()]
    row = [float(len(counts)), sum(c / n for c in counts)]
    row += [sum(pass_at_k(n, c, k) for c in counts) for k in pass_at_k_ladder(n)]
    return torch.tensor(row, dtype=torch.float64)
