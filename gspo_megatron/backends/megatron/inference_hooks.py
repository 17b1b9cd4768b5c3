"""Thin subclasses of Megatron-Core's inference classes (imported lazily by :mod:`.engine`).

Two hooks, nothing else is re-implemented:

* :class:`RolloutInferenceWrapper` (a ``GPTInferenceWrapper``) post-processes the logits of every
  forward step *before* Megatron samples from them: the padded vocabulary entries
  (``>= vocab_size``) are set to ``-inf`` and the logits are divided by the sampling temperature.
  Megatron is then asked to sample at temperature 1.0, so its own top-k / top-p / multinomial code
  runs on ``logits[:V] / T`` exactly as it would have (Megatron also divides by the temperature
  first and filters second), and any log-softmax it takes is over the real, tempered distribution.
* :class:`RolloutTextGenerationController` (a ``TextGenerationController``) records, for the static
  (legacy) engine, the token sampled at each sequence position and its log-probability
  ``log softmax(logits[:V] / T)[token]`` (computed from the same logits tensor Megatron sampled
  from), so that the EOS token's log-prob is available too (Megatron's request object omits the
  terminating token from ``generated_tokens``).

With a ``route_recorder`` set on the wrapper (R3), every forward step's MoE routes are recorded
too and handed to each request as ``gspo_routes`` (:mod:`.rollout_routes`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)


class IdTokenizer:
    """The tokenizer interface Megatron's controller touches, over token ids only.

    Prompts arrive already tokenised, so ``tokenize`` is never used for generation;
    ``detokenize`` delegates to an optional gspo tokenizer (``decode``) or returns ``""``.
    """

    def __init__(self, eos_id: int, pad_id: int, vocab_size: int, tokenizer: Any = None,
                 bos_id: int | None = None):
        self.eod = int(eos_id)
        self.pad = int(pad_id)
        self.bos = bos_id
        self.vocab_size = int(vocab_size)
        self._tok = tokenizer

    def tokenize(self, text: str) -> list[int]:
        if self._tok is None:
            raise NotImplementedError("RolloutEngine takes token ids; no tokenizer was given")
        return self._tok.encode(text)

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        if self._tok is None:
            return ""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def offsets(self, ids, text):  # only used with return_segments=True (never)
        return [0] * len(ids)


class RolloutInferenceWrapper(GPTInferenceWrapper):
    """``GPTInferenceWrapper`` whose logits are ``logits[:V] / T`` (padded entries ``-inf``)."""

    real_vocab_size: int
    temperature: float = 1.0
    forward_calls: int = 0
    route_recorder = None
    """A :class:`~.rollout_routes.RolloutRouteRecorder` while routes are recorded (R3)."""

    def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
        recorder = self.route_recorder
        if recorder is not None:
            recorder.before_forward()
        logits = super().run_one_forward_step(inference_input, recv_buffer_seq_len)
        if recorder is not None:
            recorder.after_forward(inference_input["tokens"],
                                   int(inference_input["position_ids"][0, 0]))
        self.forward_calls += 1
        if logits is None:  # not the last pipeline stage
            return None
        logits[..., self.real_vocab_size:] = float("-inf")
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits


class RolloutTextGenerationController(TextGenerationController):
    """Records ``(token, logprob)`` per sequence position during a static batch."""

    def generate_all_output_tokens_static_batch(self, active_requests, active_streams=None):
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        result = super().generate_all_output_tokens_static_batch(active_requests, active_streams)
        recorder = self.inference_wrapped_model.route_recorder
        routes = recorder.take() if recorder is not None else None  # [L, b, S, k]
        # One host copy of everything recorded: [b, positions] tokens / log-probs, the positions
        # consecutive from the first one decoded (the batch's shortest prompt length).
        positions = sorted(self._records)
        first = positions[0] if positions else 0
        if positions != list(range(first, first + len(positions))):
            raise RuntimeError("internal: the recorded decoding positions are not contiguous")
        tokens, logprobs = ((torch.stack(rows).T.tolist() for rows in
                             zip(*(self._records[p] for p in positions)))
                            if positions else ([[]] * len(result), [[]] * len(result)))
        for idx, request in enumerate(result.values()):
            request.gspo_routes = None if routes is None else routes[:, idx]
            p = len(request.prompt_tokens)
            n = request.sampling_params.num_tokens_to_generate
            # Positions p .. p + n - 1 that were decoded (all of them unless generation stopped).
            lo, hi = p - first, min(p + n, first + len(positions)) - first
            request.gspo_sampled_tokens = tokens[idx][lo:hi]
            request.gspo_sampled_logprobs = logprobs[idx][lo:hi]
        self._records = {}
        return result

    def sample_from_logits(self, last_token_logits, sampling_params=None, vocab_size=None,
                           **kwargs):
        sampled = super().sample_from_logits(last_token_logits, sampling_params, vocab_size, **kwargs)
        # last_token_logits are already logits[:V] / T (RolloutInferenceWrapper).
        logp = torch.log_softmax(last_token_logits.float(), dim=-1)
        picked = logp.gather(-1, sampled.long().unsqueeze(-1)).squeeze(-1)
        self._pending = (sampled.detach().cpu(), picked.detach().cpu())
        return sampled

    def update_generation_status(self, updated_prompts_tokens, generation_started,
                                 current_context_end_position, *args, **kwargs):
        if getattr(self, "_pending", None) is not None:
            self._records[int(current_context_end_position)] = self._pending
            self._pending = None
        return super().update_generation_status(
            updated_prompts_tokens, generation_started, current_context_end_position,
            *args, **kwargs)
