"""Subclasses of Megatron-Core's inference classes (imported lazily by :mod:`.rollout`).

* :class:`RolloutInferenceWrapper` (a ``GPTInferenceWrapper``) post-processes the logits of every
  forward step *before* Megatron samples from them: the padded vocabulary entries
  (``>= vocab_size``) are set to ``-inf`` and the logits are divided by the sampling temperature.
  Megatron is then asked to sample at temperature 1.0, so its own top-k / top-p / multinomial code
  runs on ``logits[:V] / T`` exactly as it would have (Megatron also divides by the temperature
  first and filters second), and any log-softmax it takes is over the real, tempered distribution.
  For a left-padded batch it adds the key-padding mask to every context window.
* :class:`RolloutTextGenerationController` (a ``TextGenerationController``) runs the static
  (legacy) engine's batch loop as Megatron does, for the features rollouts use, and records the
  token sampled at each sequence position with its log-probability ``log softmax(logits[:V] /
  T)[token]`` (computed from the same logits tensor Megatron sampled from), EOS included
  (Megatron's request object omits the terminating token from ``generated_tokens``).

With a ``route_recorder`` set on the wrapper (R3), every forward step's MoE routes are recorded
too and handed to each request as ``gspo_routes`` (:mod:`..routing.rollout_routes`).
"""

from __future__ import annotations


import torch
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)


class IdTokenizer:
    """The tokenizer interface Megatron's controller touches, over token ids only.

    Prompts arrive already tokenised and responses leave as ids, so nothing is ever encoded, and
    Megatron's ``generated_text`` fields stay empty (decoding every response on every generate
    would sit on the rollout's critical path for text nobody reads; the reward stage decodes).
    """

    def __init__(self, eos_id: int, pad_id: int, vocab_size: int, bos_id: int | None = None):
        self.eod = int(eos_id)
        self.pad = int(pad_id)
        self.bos = bos_id
        self.vocab_size = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError("RolloutEngine takes token ids")

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def offsets(self, ids, text):  # only used with return_segments=True (never)
        return [0] * len(ids)


class RolloutInferenceWrapper(GPTInferenceWrapper):
    """``GPTInferenceWrapper`` whose logits are ``logits[:V] / T`` (padded entries ``-inf``), and
    whose context windows carry a key-padding mask while the batch's prompts are left-padded."""

    real_vocab_size: int
    temperature: float = 1.0
    forward_calls: int = 0
    route_recorder = None
    """A :class:`~..routing.rollout_routes.RolloutRouteRecorder` while routes are recorded (R3)."""
    @property
    def left_padding(self) -> torch.Tensor | None:
        """``[B]`` pad tokens in front of each prompt of the current static batch, or None (prompts
        as given). Set by the rollout engine around one ``generate`` of a left-padded batch and
        kept on the KV-cache context, where the attention reads it for its rotary positions
        (:class:`~gspo_megatron.backends.megatron.kernels.local.RopeOnceSelfAttention`)."""
        return getattr(self.inference_context, "left_padding", None)

    @left_padding.setter
    def left_padding(self, pads: torch.Tensor | None) -> None:
        self.inference_context.left_padding = pads

    def get_batch_for_context_window(self, inference_input, context_start_position,
                                     context_end_position):
        batch = super().get_batch_for_context_window(inference_input, context_start_position,
                                                     context_end_position)
        pads = self.left_padding
        if pads is not None:
            # Megatron's convention, True = masked: causal, and no query sees a pad key except a
            # pad query its own (so no softmax row is empty). [B, 1, end - start, end], built per
            # window (a decode step's is [B, 1, 1, end]) instead of one [B, 1, S, S] mask.
            i = torch.arange(context_start_position, context_end_position).view(1, -1, 1)
            j = torch.arange(context_end_position).view(1, 1, -1)
            masked = (j > i) | ((j < pads.view(-1, 1, 1)) & (j != i))
            batch["attention_mask"] = masked.unsqueeze(1)
        return batch

    def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
        recorder = self.route_recorder
        if recorder is not None:
            recorder.before_forward()
        logits = super().run_one_forward_step(inference_input, recv_buffer_seq_len)
        if recorder is not None:
            recorder.after_forward(inference_input, self.inference_context)
        self.forward_calls += 1
        if logits is None:  # not the last pipeline stage
            return None
        logits[..., self.real_vocab_size:] = float("-inf")
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits


class RolloutTextGenerationController(TextGenerationController):
    """Megatron's controller with a lean static-batch loop that records what rollouts need."""

    @torch.inference_mode()
    def generate_all_output_tokens_static_batch(self, active_requests, active_streams=None):
        """One static batch, as ``TextGenerationController.generate_all_output_tokens_static_batch``
        (megatron-core 0.16) runs it, for the features rollouts use.

        Same loop: the first forward step prefills up to the shortest prompt, every later one
        feeds one position of every row (the longer prompts' own tokens until they start
        generating); each step Megatron's ``sample_from_logits`` draws from the last position's
        logits (``logits[:V] / T``, :class:`RolloutInferenceWrapper`); a row stops at its first
        EOS (never with ``no_early_termination``), the loop when every row has stopped or the
        longest reaches ``prompt + num_tokens_to_generate``; under PP the last stage's logits are
        broadcast. Per request it sets Megatron's ``generated_tokens`` (EOS excluded),
        ``generated_length`` and ``status``, and ``gspo_sampled_tokens`` /
        ``gspo_sampled_logprobs``: the tokens sampled at positions ``p, p + 1, ...`` (EOS
        included) and ``log softmax(logits[:V] / T)[token]`` from the logits sampled from.

        Left out (never used by the rollout engine; a request asking for one is refused):
        streaming, CUDA graphs, prompt and top-n log-probs. Also Megatron's text, per-token
        latencies and the per-request host work behind them: ~8,000 scalar tensor ops per call
        at batch 128 (a Python ``max``/``min`` over a tensor, per-request slicing and ``item``),
        ~12 ms of a 115 ms generate of TRL's workload.
        """
        from megatron.core.inference.communication_utils import broadcast_from_last_pipeline_stage
        from megatron.core.inference.inference_request import Status

        requests = list(active_requests.values())
        sp = requests[0].sampling_params
        if active_streams or sp.return_log_probs or sp.top_n_logprobs > 0:
            raise NotImplementedError("the rollout controller does not stream or return "
                                      "Megatron's log-probs (it records its own)")
        wrapper = self.inference_wrapped_model
        lengths = [len(r.prompt_tokens) for r in requests]
        shortest, longest, n_new = min(lengths), max(lengths), sp.num_tokens_to_generate
        if n_new < 1:
            raise ValueError("the rollout controller generates at least one token "
                             f"(num_tokens_to_generate={n_new})")
        total = longest + n_new  # [B, total]: prompts, then what is generated
        if total > wrapper.inference_wrapper_config.inference_max_seq_length:
            raise ValueError(f"prompt + generated tokens ({total}) exceed the inference max "
                             f"sequence length {wrapper.inference_wrapper_config.inference_max_seq_length}")
        eod = self.tokenizer.eod
        device = next(wrapper.model.parameters()).device  # the model's (CUDA on a GPU)
        tokens = torch.tensor([list(r.prompt_tokens) + [eod] * (total - n)
                               for r, n in zip(requests, lengths)], device=device)
        # [B, total]: log-prob of the token sampled there
        logprobs = torch.zeros(tokens.shape, device=device)
        prompt_lengths = torch.tensor(lengths, device=device)
        stop_id = -1 if getattr(sp, "no_early_termination", False) else eod
        done = torch.zeros(len(requests), dtype=torch.bool, device=device)
        generated = torch.zeros(len(requests), dtype=torch.long, device=device)  # EOS not counted
        vocab = wrapper.inference_wrapper_config.padded_vocab_size

        wrapper.prep_model_for_inference()  # eval mode, fresh KV cache
        inference_input = wrapper.prep_inference_input(tokens)
        context = wrapper.inference_context
        start, end = 0, shortest
        while True:
            context.materialize_only_last_token_logits = True
            logits = wrapper.run_one_forward_step(
                wrapper.get_batch_for_context_window(inference_input, start, end))
            if self.model_is_pipeline_parallel:
                logits = broadcast_from_last_pipeline_stage(
                    [len(requests), 1, vocab], dtype=wrapper.inference_wrapper_config.params_dtype,
                    tensor=logits, pp_group=self.pp_group)
            last = logits[:, -1, :]  # [B, V]: logits[:V] / T
            sampled = self.sample_from_logits(last, sp, vocab)
            picked = torch.log_softmax(last.float(), dim=-1).gather(
                -1, sampled.long().unsqueeze(-1)).squeeze(-1)
            # None: every row generates; else rows whose prompt reaches past `end` keep its token.
            started = None if end >= longest else prompt_lengths <= end
            tokens[:, end] = sampled if started is None else torch.where(started, sampled,
                                                                         tokens[:, end])
            logprobs[:, end] = picked
            hit = tokens[:, end] == stop_id
            if started is not None:
                hit &= started
            done |= hit
            generated += ~done if started is None else ~done & started
            start, end = end, end + 1
            if bool(done.all()) or end >= total:
                break
            if started is None:  # Megatron's rule: decode mode once every row has started
                context.enable_decode_mode()

        recorder = wrapper.route_recorder
        routes = recorder.take() if recorder is not None else None  # [L, b, S, k]
        kept = generated.clamp(max=n_new).tolist()  # Megatron's trim of early-starting rows
        rows, lps = tokens.tolist(), logprobs.tolist()
        for i, request in enumerate(requests):
            p, n = lengths[i], kept[i]
            request.generated_tokens = tokens[i, p:p + n]
            request.generated_length = n
            request.status = Status.COMPLETED
            stop = n + 1 if n < n_new else n  # a row that stopped early ends with its EOS
            request.gspo_sampled_tokens = rows[i][p:p + stop]
            request.gspo_sampled_logprobs = lps[i][p:p + stop]
            request.gspo_routes = None if routes is None else routes[:, i]
        return active_requests
