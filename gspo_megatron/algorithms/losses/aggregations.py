"""How a loss's per-token (or per-sequence) terms become one number: the ``loss.aggregation``
values, each a token sum or a token mean within every sequence, and what the sum over sequences
is divided by.

The normaliser is a function of the batch layout only (never of the loss's values), so the
objective (:class:`~gspo_megatron.algorithms.objectives.PolicyGradientObjective`) can sum it over
data-parallel ranks and hand every microbatch the whole minibatch's; the summed microbatch losses
then give exactly the whole minibatch's gradient under any split.

Peers' names (verl ``loss_agg_mode`` in ``verl/trainer/ppo/core_algos.py::agg_loss``, TRL
``loss_type`` in ``trl/trainer/grpo_trainer.py``):

==========================  ===========================  =======================================
ours                        verl ``loss_agg_mode``        TRL ``loss_type``
==========================  ===========================  =======================================
``seq_mean_token_mean``     ``seq-mean-token-mean``       ``grpo``, ``sapo``
``token_mean``              ``token-mean``                ``dapo``, ``cispo``; ``bnpo`` on one
                                                          batch (TRL's bnpo divides by each
                                                          device micro-batch's tokens, so its
                                                          gradient depends on the split)
``seq_mean_token_sum``      ``seq-mean-token-sum``        ``luspo`` (on the sequence ratio)
``seq_mean_token_sum_norm`` ``seq-mean-token-sum-norm``   ``dr_grpo``
==========================  ===========================  =======================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AGGREGATIONS", "Aggregation", "every_aggregation"]


@dataclass(frozen=True)
class Aggregation:
    """One ``loss.aggregation`` value."""

    name: str
    per_sequence: Literal["mean", "sum"]
    """Each sequence's terms: mean over its ``|y_i|`` response tokens, or their sum."""
    normalizer: Literal["sequences", "tokens", "sequences_x_budget"]
    """The sum over sequences is divided by the minibatch's number of sequences ``B``, its number
    of response tokens, or ``B * L`` with ``L`` the response budget (``rollout.max_new_tokens``)."""
    doc: str


AGGREGATIONS: dict[str, Aggregation] = {a.name: a for a in (
    Aggregation("seq_mean_token_mean", "mean", "sequences",
                "mean over each sequence's response tokens, then mean over sequences: "
                "(1/G) sum_i (1/|y_i|) sum_t (GRPO as written in GSPO arXiv 2507.18071 Eq. 2; "
                "GSPO Eq. 5; SAPO arXiv 2511.20347)"),
    Aggregation("token_mean", "sum", "tokens",
                "sum over every response token of the minibatch / its number of response tokens: "
                "1/(sum_i |y_i|) sum_i sum_t (DAPO arXiv 2503.14476, its token-level loss; CISPO, "
                "MiniMax-M1 arXiv 2506.13585; TRL's 'dapo' and 'bnpo')"),
    Aggregation("seq_mean_token_sum", "sum", "sequences",
                "sum over each sequence's response tokens, then mean over sequences; on the "
                "sequence ratio (gspo) each sequence's objective is weighted by its length: "
                "LUSPO (arXiv 2602.05261, TRL 'luspo')"),
    Aggregation("seq_mean_token_sum_norm", "sum", "sequences_x_budget",
                "sum over every response token / (B * L), L the response budget "
                "rollout.max_new_tokens, a constant: Dr. GRPO (arXiv 2503.20783, which drops "
                "GRPO's 1/|y_i|; TRL 'dr_grpo' with L = max_completion_length)"),
)}


def every_aggregation(default: str) -> tuple[str, ...]:
    """Every aggregation, ``default`` first: what a token-level loss accepts (its terms are per
    token, so each aggregation means what its name says)."""
    if default not in AGGREGATIONS:
        raise KeyError(f"unknown aggregation {default!r}; known: {list(AGGREGATIONS)}")
    return (default, *(name for name in AGGREGATIONS if name != default))
