"""One sampler and one finish rule for every decoding path of the rollout engine.

Megatron's per-step loop (:meth:`.dynamic.DynamicRollout._step`), the multi-step rounds
(:meth:`.rounds.FastDecoder.run`) and the prefills through the step function all draw each
request's next token and its log-prob with :class:`Sampler`, and decide whether the request
ended with :class:`FinishRule`. Both are small pure-torch objects with no engine state, so a
multi-turn rollout (tool calls: more stop tokens, a budget per turn) can use them as they are:

    sampler = Sampler(top_k=0, top_p=0.0, generator=g)       # or method="gumbel"
    tokens, logprobs = sampler(logits)                        # logits [n, V] / temperature
    ended = FinishRule().ends(tokens, stop_ids, lengths, max_lengths)

Two ways to draw, the same distribution (``tests/unit/test_sampler.py``: a chi-square test):

* ``multinomial`` (the engine's): Megatron's ``_torch_sampling_func`` op for op (top-k / top-p
  filters, softmax, ``torch.multinomial`` on the controller's generator), the log-prob from a
  log-softmax of the unfiltered logits: the tokens and log-probs the engine always drew, bitwise.
* ``gumbel``: ``argmax(logits + G)`` with ``G = -log(-log(U))`` from the generator, the log-prob
  as ``logit - logsumexp(logits)``: no softmax or ``[n, V]`` log-softmax tensor and no
  data-dependent kernel (``torch.multinomial``), what a sampler inside a captured decoding step
  needs. Greedy (``top_k`` 1) is the argmax either way.
"""

from __future__ import annotations

import dataclasses

import torch


def top_k_filter_(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``logits [n, V]`` with every entry below its row's ``top_k``-th largest set to -inf, in
    place (Megatron's ``modify_logits_for_top_k_filtering``)."""
    keep = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill_(logits < keep, float("-inf"))


def top_p_filter_(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits [n, V]`` outside each row's nucleus of mass ``top_p`` set to -inf, in place
    (Megatron's ``modify_logits_for_top_p_filtering``: the token that crosses ``top_p`` kept,
    the most likely always)."""
    ordered, order = torch.sort(logits, descending=True)
    drop = ordered.softmax(dim=-1).cumsum(dim=-1) > top_p
    drop[:, 1:] = drop[:, :-1].clone()
    drop[..., 0] = 0
    return logits.masked_fill_(drop.scatter(1, order, drop), float("-inf"))


@dataclasses.dataclass
class Sampler:
    """Draws one token per row of ``[n, V]`` logits (already divided by the temperature) and
    returns ``(tokens [n] long, logprobs [n] fp32)``: the token's log-probability under the
    unfiltered logits. ``top_k`` 1: greedy; ``top_k`` > 1 or ``top_p`` > 0 (not both): the
    filtered distribution; ``generator``: the draws' (the controller's ``sampling_rng``)."""

    top_k: int = 0
    top_p: float = 0.0
    generator: torch.Generator | None = None
    method: str = "multinomial"
    """``multinomial`` (Megatron's draws, bitwise) or ``gumbel`` (Gumbel-max): see the module."""
    invariant: bool = False
    """``precision.batch_invariant``: the log-probs by
    :func:`~..kernels.batch_invariant.token_logprobs`, the trainer's function (the draws are
    unchanged)."""

    def __post_init__(self):
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError("Sampler: top_k and top_p cannot both be set")
        if self.method not in ("multinomial", "gumbel"):
            raise ValueError(f"Sampler: method must be 'multinomial' or 'gumbel', got "
                             f"{self.method!r}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    def __call__(self, logits: torch.Tensor, vocab: int | None = None):
        """``logits [n, V]`` fp32; ``vocab``: draw from the first ``vocab`` columns only (the
        padded vocabulary's others have probability 0; the log-prob still over all ``V``)."""
        tokens = self.draw(logits if vocab is None else logits[:, :vocab])
        return tokens, self.logprobs(logits, tokens)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[n]``: ``tokens [n]``'s log-probabilities under ``logits [n, V]`` (unfiltered)."""
        if self.invariant:
            from gspo_megatron.backends.megatron.kernels.batch_invariant import token_logprobs

            return token_logprobs(logits, tokens)[0]
        if self.method == "gumbel":
            return (logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                    - torch.logsumexp(logits, dim=-1))
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n]`` long: one token per row of ``logits [n, V]``."""
        if self.greedy:
            return torch.argmax(logits, dim=-1)
        filtered = logits
        if self.top_k > 1 or self.top_p > 0.0:
            filtered = logits.clone()
            if self.top_k > 1:
                top_k_filter_(filtered, self.top_k)
            else:
                top_p_filter_(filtered, self.top_p)
        if self.method == "gumbel":
            u = torch.rand(filtered.shape, generator=self.generator, device=filtered.device,
                           dtype=torch.float32)
            # G = -log(-log U): argmax(logits + G) is a draw from softmax(logits); U's open
            # interval (0, 1) keeps G finite (tiny: the smallest positive fp32 step)
            gumbel = -torch.log(-torch.log(u.clamp_(torch.finfo(u.dtype).tiny, 1.0 - 2 ** -24)))
            return torch.argmax(filtered + gumbel, dim=-1)
        return torch.multinomial(filtered.softmax(dim=-1), num_samples=1,
                                 generator=self.generator).view(-1)


@dataclasses.dataclass(frozen=True)
class FinishRule:
    """When a request ends (Megatron's rule): it sampled one of its stop tokens, or its
    sequence reached its length limit (prompt + budget)."""

    def ends(self, tokens: torch.Tensor, stop_ids: torch.Tensor, lengths: torch.Tensor,
             max_lengths: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool. ``tokens [n]``: just sampled; ``stop_ids [n]`` (-1: none) or
        ``[n, S]``: each request's stop tokens; ``lengths [n]``: its tokens before this one
        (prompt + written, the sampled token's position); ``max_lengths [n]``: its limit."""
        if stop_ids.dim() == 1:
            stopped = tokens == stop_ids
        else:
            stopped = (tokens.unsqueeze(-1) == stop_ids).any(dim=-1)
        return stopped | (lengths + 1 >= max_lengths)
