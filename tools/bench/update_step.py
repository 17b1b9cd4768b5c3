"""Benchmark 2: one GSPO update step vs one plain cross-entropy step, same model and tokens.

    python -m tools.bench.update_step [--rounds 8]

Model: the tiny preset widened (``tools/bench/_model.py`` SMALL: 4 layers, hidden 256, 8 experts
top-2, vocabulary 4096), fp32, Megatron local spec, one process. Batch: 16 sequences x 256 tokens
(prompt 64), micro-batch 8, so each step is two microbatches through Megatron's schedule.

* GSPO: ``zero_grad`` + ``MegatronPolicy.train_minibatch`` of a :class:`PolicyGradientObjective`
  (log-probs + entropy, GSPO loss) + optimiser step;
* CE: the same with :class:`NLLObjective` (token NLL through the same schedule and log-prob
  kernel, no entropy).

Both alternate in one process (A, B, B, A, ...); the figure is the median per-round ratio.
"""

from __future__ import annotations

TARGET = 1.05


def run(smoke: bool = False, rounds: int = 8, batch: int = 16, seq: int = 256,
        micro_batch_size: int = 8, threads: int = 1) -> dict:
    import torch

    from gspo_megatron.algorithms import NLLObjective, PolicyGradientObjective, PolicyLossConfig
    from gspo_megatron.backends.megatron.schedule import ScoringConfig
    from tools.bench import _model
    from tools.bench.common import (interleaved, make_result, median, median_ratio,
                                    quiet_megatron, row)

    quiet_megatron()
    torch.set_num_threads(threads)
    if smoke:
        rounds, batch, seq, micro_batch_size = 1, 4, 16, 2
    cfg = _model.model_config(smoke, seq_length=seq)
    with _model.distributed(cfg) as groups:
        pol = _model.policy(cfg, groups)
        scoring = ScoringConfig(vocab_size=cfg.vocab_size)
        data = _model.random_batch(cfg.vocab_size, batch, seq, prompt=seq // 4)
        _model.with_old_logprobs(pol, data, micro_batch_size, scoring, groups)
        pol.micro_batch_size, pol.scoring = micro_batch_size, scoring  # as the trainer builds it
        gspo_objective = PolicyGradientObjective(PolicyLossConfig(variant="gspo"))

        def gspo():
            pol.zero_grad()
            pol.train_minibatch(data, gspo_objective)
            pol.optimizer_step()

        def ce():
            pol.zero_grad()
            pol.train_minibatch(data, NLLObjective())
            pol.optimizer_step()

        times = interleaved({"gspo": gspo, "ce": ce}, rounds=rounds, warmup=1)
    ratio = median_ratio(times, "gspo", "ce")
    tokens = batch * seq
    rows = [row("GSPO update step", median(times["gspo"]), "s"),
            row("CE update step", median(times["ce"]), "s"),
            row("GSPO tokens/s", tokens / median(times["gspo"]), "tok/s"),
            row("GSPO / CE step time", ratio, "x")]
    return make_result(
        "update_step", "GSPO update step vs plain cross-entropy step (same model, same tokens)",
        f"GSPO / CE <= {TARGET}", ratio <= TARGET, rows, {"gspo_vs_ce": ratio},
        config={"model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size",
                                                       "num_moe_experts", "moe_router_topk",
                                                       "vocab_size")},
                "batch": batch, "seq": seq, "micro_batch_size": micro_batch_size,
                "rounds": rounds, "threads": threads,
                "times": {k: [round(x, 4) for x in v] for k, v in times.items()}},
        notes=[f"{rounds} interleaved rounds after 1 warm-up; torch threads {threads}"])


def _args(ap) -> None:
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
