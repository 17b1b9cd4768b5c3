"""The policy's MoE routing in the RL loop, built once from :class:`RoutingConfig`: the one place
that decides, by ``routing.replay`` and ``routing.diagnostics``, what each pass records or
replays and which ``routing/*`` metrics follow. The trainer and the stages call the same methods
whatever the mode (:class:`gspo_megatron.policy.Routing` / :class:`~gspo_megatron.policy.StepRouting`).

One RL step (:meth:`PolicyRouting.start_step`):

==================  =========================================  ===================================
pass                none + diagnostics / R2                    R3
==================  =========================================  ===================================
old log-probs       record the routers' own routes             replay the rollout engine's routes
                                                               (the routers' own top-k captured
                                                               beside them)
after it            ``routing/rollout/*``: engine vs trainer routes (when the engine recorded)
update ``i``        none: record; R2: replay the old routes    replay the old (= engine's) routes
after update ``i``  ``routing/drift/*`` (free: the update forward's own routes vs the old ones);
                    on diagnosed steps (``diagnostics_interval``) the diagnostics' extra forwards
==================  =========================================  ===================================

"Old routes" are the routes the old-log-prob pass used, rows in the step's batch order, so each
minibatch (a row permutation slice) replays exactly its rows. The clip rule the diagnostics count
with is the objective's (:meth:`PolicyGradientObjective.clipped_positions`), not a config.
"""

from __future__ import annotations

import dataclasses

import torch

from gspo_megatron.backends.megatron.routing.rollout_routes import rollout_disagreement, rollout_route_store
from gspo_megatron.backends.megatron.routing.replay import ModelRouting, RouteStore
from gspo_megatron.backends.megatron.routing.diagnostics import route_drift, routing_diagnostics
from gspo_megatron.config import RoutingConfig
from gspo_megatron.metrics import Stopwatch
from gspo_megatron.policy import PolicyBatch, RolloutSample


class PolicyRouting:
    """MoE routing of one :class:`~.policy.MegatronPolicy` for RL steps (``routing`` section)."""

    def __init__(self, policy, cfg: RoutingConfig):
        self.policy, self.cfg = policy, cfg

    def start_step(self, batch: PolicyBatch, samples: list[RolloutSample], step: int
                   ) -> "StepRouting":
        """The routing of RL step ``step`` on ``batch`` (``samples``: its rollouts, in row order,
        carrying the engine's routes when it recorded them)."""
        rollout = None
        if self.cfg.records_rollout_routes:
            rollout = rollout_route_store(samples, batch.layout, self.policy.model_routing)
        return StepRouting(self.policy, self.cfg, batch, rollout,
                           diagnose=self.cfg.diagnoses(step))


class StepRouting:
    """What one RL step records and replays, and the metrics that come of it."""

    def __init__(self, policy, cfg: RoutingConfig, batch: PolicyBatch, rollout: RouteStore | None,
                 diagnose: bool):
        self.policy, self.cfg, self.batch = policy, cfg, batch
        self.routing: ModelRouting = policy.model_routing
        self.rollout = rollout
        """The engine's routes aligned with ``batch`` (R3 / diagnostics), else None."""
        self.diagnose = diagnose
        self.replays = cfg.replay in ("r2", "r3")
        self.old: RouteStore | None = None
        """The routes the old-log-prob pass used (set by :meth:`after_old_pass`)."""
        self._hooks = None
        self._rows: torch.Tensor | slice | None = None
        self._diagnostics_s = 0.0

    # -- the old-log-prob pass
    def old_pass(self):
        """Hooks for the old-policy log-prob pass over the step's batch."""
        if self.cfg.replay == "r3":
            self._hooks = self.routing.replayer(self.rollout, self.policy.micro_batch_size,
                                                capture_natural=True)
        else:
            self._hooks = self.routing.recorder()
        return self._hooks

    def after_old_pass(self, train_lp: torch.Tensor | None) -> dict[str, float]:
        """Keep the routes the pass used; ``routing/rollout/*`` when the engine recorded its own
        (collective). ``train_lp``: the pass's log-probs (None off the last pipeline stage)."""
        if self.cfg.replay == "r3":
            self.old, chosen = self._hooks.replayed_store(), self._hooks.natural_store()
        else:
            self.old = chosen = self._hooks.store()
        if self.rollout is None:
            return {}
        return rollout_disagreement(self.routing, self.rollout, chosen, self.batch.response_mask,
                                    train_lp, self.batch.rollout_logprobs, self.policy.groups,
                                    lengths=_lengths(self.batch))

    # -- the minibatch updates
    def update(self, rows: torch.Tensor | slice):
        """Hooks for the update forward of the minibatch made of the batch's rows ``rows``:
        replay their old routes (R2 / R3) or record the routes free routing takes."""
        self._rows = rows
        if self.replays:
            self._hooks = self.routing.replayer(self.old.select(rows),
                                                self.policy.micro_batch_size, capture_natural=True)
        else:
            self._hooks = self.routing.recorder()
        return self._hooks

    def after_update(self, i: int, minibatch: PolicyBatch, objective) -> dict[str, float]:
        """After minibatch ``i``'s optimizer step: ``routing/drift/*`` from the routes its update
        forward took (no forward) and, on a diagnosed step, the diagnostics of the updated policy
        on the same minibatch (``objective``: its clip rule and temperature)."""
        old = self.old.select(self._rows)
        taken = self._hooks.natural_store() if self.replays else self._hooks.store()
        rate, per_layer = route_drift(self.routing, old, taken, minibatch.response_mask,
                                      _lengths(minibatch))
        out = {f"routing/drift/after_{i}_updates": rate}
        if i >= 1:
            out["routing/drift/change_rate"] = rate
            out.update({f"routing/drift/change_rate/layer_{layer}": v
                        for layer, v in enumerate(per_layer)})
        if self.diagnose:
            watch = Stopwatch()
            policy = self.policy
            scoring = dataclasses.replace(policy.scoring, temperature=objective.temperature)
            diag = routing_diagnostics(policy.model, self.routing, minibatch, old,
                                       policy.batching, scoring, policy.groups,
                                       objective.clipped_positions,
                                       replay_gap=self.cfg.replay_gap)
            if "routing/change_rate" in diag:
                diag[f"routing/change_rate/after_update_{i}"] = diag["routing/change_rate"]
            out.update(diag)
            self._diagnostics_s += watch.elapsed()
        return out

    def timings(self) -> dict[str, float]:
        """``perf/routing_diagnostics_s``: the step's diagnostics time (diagnosed steps only)."""
        return {"perf/routing_diagnostics_s": self._diagnostics_s} if self.diagnose else {}


def _lengths(batch: PolicyBatch) -> torch.Tensor | None:
    """``[B]`` the batch's sequence lengths (None for a batch without a layout)."""
    return batch.layout.lengths if batch.layout is not None else None
