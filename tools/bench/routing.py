"""Benchmark 4: RL step time with routing replay (R2) and with routing diagnostics, vs off.

    python -m tools.bench.routing [--rounds 5]

Same model and batch as the update-step benchmark (``tools/bench/_model.py`` SMALL). One timed
"training phase" is what the trainer does after the rewards: the old-policy log-prob pass
(:func:`compute_logprobs`) and :func:`gspo_megatron.stages.update_stage` (2 minibatches, one
optimiser step each), with

* ``off``: no :class:`ModelRouting` attached (``routing.replay='none'``, no diagnostics);
* ``r2``: the old-policy pass records routes, every update forward/recompute replays them;
* ``diag``: ``routing.diagnostics=True`` (replay gap on, the default): one extra recorded forward
  plus one replayed forward per minibatch, by design;
* ``diag_nogap``: diagnostics with ``routing.replay_gap=False`` (the recorded forward only);
* ``drift``: ``routing.diagnostics=True`` on a step the interval skips: the old-policy pass
  records routes and the update forwards record free routes for ``routing/drift/*`` (no extra
  forward);
* ``diag_every``: ``routing.diagnostics_interval=N`` (``--diag-interval``, default 8): N
  consecutive RL steps timed together, the first with the diagnostics (replay gap on), compared
  with N ``off`` steps (N x the ``off`` time of the same round).

``off`` runs on its own copy of the policy (same initial weights) so that it carries no replay
objects, exactly as in the trainer. Variants alternate in one process; medians of per-round ratios.
The full-step ratio adds the rollout time of the same RL batch (measured in the same rounds): the
routing switches do not touch the rollout.
"""

from __future__ import annotations

TARGET = 1.05


def run(smoke: bool = False, rounds: int = 5, batch: int = 16, seq: int = 256,
        micro_batch_size: int = 8, num_minibatches: int = 2, threads: int = 1,
        diag_interval: int = 8) -> dict:
    import dataclasses

    import torch

    from gspo_megatron.config import DEMO_RECIPE, RolloutConfig, TrainConfig, load_config
    from gspo_megatron.backends.megatron.routing.session import StepRouting
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
    from tools.bench import _model
    from tools.bench.common import (interleaved, make_result, median, median_ratio,
                                    quiet_megatron, row)

    try:
        from gspo_megatron.stages import update_stage
        if not hasattr(TrainConfig(), "routing"):
            raise ImportError("TrainConfig has no routing section")
    except ImportError as exc:  # routing replay not in this checkout
        return make_result("routing", "Routing replay (R2) and diagnostics vs off",
                           f"step time with R2 / diagnostics on <= {TARGET}x off", None,
                           [row("TODO: routing replay not available", None, "")],
                           notes=[f"skipped: {exc}"])

    quiet_megatron()
    torch.set_num_threads(threads)
    if smoke:
        rounds, batch, seq, micro_batch_size, diag_interval = 1, 4, 16, 2, 2
    cfg = _model.model_config(smoke, seq_length=seq)
    tcfg = load_config(DEMO_RECIPE)  # the demo's loss and optimiser (the measured figures')
    tcfg.trainer.num_minibatches = num_minibatches
    tcfg.trainer.micro_batch_size = micro_batch_size
    variants = {
        "off": dataclasses.replace(tcfg, routing=dataclasses.replace(tcfg.routing, replay="none",
                                                                    diagnostics=False)),
        "r2": dataclasses.replace(tcfg, routing=dataclasses.replace(tcfg.routing, replay="r2",
                                                                   diagnostics=False)),
        "diag": dataclasses.replace(tcfg, routing=dataclasses.replace(tcfg.routing, replay="none",
                                                                     diagnostics=True)),
        "diag_nogap": dataclasses.replace(tcfg, routing=dataclasses.replace(
            tcfg.routing, replay="none", diagnostics=True, replay_gap=False)),
        "drift": dataclasses.replace(tcfg, routing=dataclasses.replace(
            tcfg.routing, replay="none", diagnostics=True, diagnostics_interval=2)),
        "diag_every": dataclasses.replace(tcfg, routing=dataclasses.replace(
            tcfg.routing, replay="none", diagnostics=True, diagnostics_interval=diag_interval)),
    }
    with _model.distributed(cfg) as groups:
        plain = _model.policy(cfg, groups)
        routed = _model.policy(cfg, groups)
        for pol in (plain, routed):  # the trainer builds its policy with these
            pol.micro_batch_size, pol.scoring.vocab_size = micro_batch_size, cfg.vocab_size
        scoring = ScoringConfig(vocab_size=cfg.vocab_size)
        data = _model.random_batch(cfg.vocab_size, batch, seq, prompt=seq // 4)
        noise = 0.05 * torch.randn(data.tokens.shape, generator=torch.Generator().manual_seed(1))

        def phase(name, step=0):
            vcfg = variants[name]
            pol = plain if name == "off" else routed
            # As in Trainer.rl_step, through the policy's step routing (R2 or diagnostics: the
            # old pass records routes for the replay, the drift metrics and, on a diagnosed
            # step, the diagnostics); no rollout routes here (a random batch, not sampled).
            routing = (StepRouting(routed, vcfg.routing, data, rollout=None,
                                   diagnose=vcfg.routing.diagnoses(step))
                       if name != "off" else None)
            lp, _ = compute_logprobs(pol.model, data, micro_batch_size, scoring, groups,
                                     routing=routing.old_pass() if routing else None)
            if routing is not None:
                routing.after_old_pass(lp)
            data.old_logprobs = (lp + noise * data.response_mask).detach()
            return update_stage(pol, data, vcfg, seed=0, step=step, routing=routing)

        def steps(name, n):
            for step in range(n):
                phase(name, step)

        # The rollout of the same RL batch (prompt -> seq tokens), for the full-step ratio.
        from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine

        prompt_len = seq // 4
        engine = RolloutEngine(plain.model, groups, eos_id=cfg.vocab_size - 1, pad_id=0,
                               vocab_size=cfg.vocab_size,
                               config=RolloutConfig(max_new_tokens=seq - prompt_len,
                                                    max_batch_size=batch, temperature=1.0),
                               max_sequence_length=seq)
        prompts = data.tokens[:, :prompt_len].tolist()
        fns = {n: (lambda n=n: phase(n)) for n in variants if n not in ("diag_every", "drift")}
        fns["drift"] = lambda: phase("drift", step=1)  # interval 2: step 1 is not diagnosed
        fns["diag_every"] = lambda: steps("diag_every", diag_interval)
        fns["rollout"] = lambda: engine.generate(prompts, seed=0)
        times = interleaved(fns, rounds=rounds, warmup=1)
        diag_metrics = phase("diag")
    r2 = median_ratio(times, "r2", "off")
    dg = median_ratio(times, "diag", "off")
    per_round = {n: times[n] for n in variants if n != "diag_every"}
    full = {n: [t + r for t, r in zip(v, times["rollout"])] for n, v in per_round.items()}
    # diag_every: N steps against N x off (and N rollouts), round by round.
    n_off = {"off": [diag_interval * t for t in times["off"]], "diag_every": times["diag_every"]}
    de = median_ratio(n_off, "diag_every", "off")
    n_full = {"off": [diag_interval * (t + r) for t, r in zip(times["off"], times["rollout"])],
              "diag_every": [t + diag_interval * r
                             for t, r in zip(times["diag_every"], times["rollout"])]}
    de_full = median_ratio(n_full, "diag_every", "off")
    r2_full = median_ratio(full, "r2", "off")
    dg_full = median_ratio(full, "diag", "off")
    dn = median_ratio(times, "diag_nogap", "off")
    dr = median_ratio(times, "drift", "off")
    dr_full = median_ratio(full, "drift", "off")
    dn_full = median_ratio(full, "diag_nogap", "off")
    rows = [row("training phase, off", median(times["off"]), "s"),
            row("training phase, R2", median(times["r2"]), "s"),
            row("training phase, diagnostics", median(times["diag"]), "s"),
            row("training phase, diagnostics without replay gap", median(times["diag_nogap"]), "s"),
            row("training phase, drift metrics only", median(times["drift"]), "s"),
            row("rollout of the same batch", median(times["rollout"]), "s"),
            row("R2 / off (training phase)", r2, "x"),
            row("diagnostics / off (training phase)", dg, "x"),
            row("R2 / off (full step incl. rollout)", r2_full, "x"),
            row("diagnostics / off (full step incl. rollout)", dg_full, "x"),
            row("diagnostics, no replay gap / off (training phase)", dn, "x"),
            row("diagnostics, no replay gap / off (full step incl. rollout)", dn_full, "x"),
            row("drift metrics only (a step the diagnostics skip) / off (training phase)", dr, "x"),
            row("drift metrics only / off (full step incl. rollout)", dr_full, "x"),
            row(f"diagnostics every {diag_interval} steps / off (training phase)", de, "x"),
            row(f"diagnostics every {diag_interval} steps / off (full step incl. rollout)",
                de_full, "x")]
    return make_result(
        "routing", "Routing replay (R2) and routing diagnostics vs off",
        f"R2 (training phase) and diagnostics every {diag_interval} steps (full step) "
        f"<= {TARGET}x off", r2 <= TARGET and de_full <= TARGET,
        rows, {"r2_vs_off": r2, "diag_vs_off": dg, "r2_vs_off_full_step": r2_full,
               "diag_vs_off_full_step": dg_full, "diag_nogap_vs_off": dn,
               "diag_nogap_vs_off_full_step": dn_full, "diag_every_vs_off": de,
               "diag_every_vs_off_full_step": de_full, "drift_vs_off": dr,
               "drift_vs_off_full_step": dr_full},
        config={"batch": batch, "seq": seq, "micro_batch_size": micro_batch_size,
                "num_minibatches": num_minibatches, "rounds": rounds, "threads": threads,
                "diag_interval": diag_interval,
                "diagnostics_s_per_step": diag_metrics.get("perf/routing_diagnostics_s"),
                "times": {k: [round(x, 4) for x in v] for k, v in times.items()}},
        notes=[f"{rounds} interleaved rounds after 1 warm-up; torch threads {threads}",
               "diagnostics add 2 forwards per minibatch (recorded + replayed) on the steps they "
               "run, by design: every step misses the target, routing.diagnostics_interval "
               "amortises them; see docs/benchmarks.md"])


def _args(ap) -> None:
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--diag-interval", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
