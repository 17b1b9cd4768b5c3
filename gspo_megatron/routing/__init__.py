"""MoE routing replay (R2) and in-loop routing diagnostics; see ``docs/routing.md``.

* :mod:`gspo_megatron.routing.stats`: pure-torch statistics (no Megatron import).
* :mod:`gspo_megatron.routing.replay`: per-model record/replay on Megatron-Core's ``RouterReplay``.
* :mod:`gspo_megatron.routing.diagnostics`: the ``routing/*`` metrics computed in the RL loop.
"""

from gspo_megatron.routing.stats import route_dtype

__all__ = ["ModelRouting", "RouteStore", "route_drift", "route_dtype", "routing_diagnostics"]


def __getattr__(name):  # Megatron-dependent parts load lazily
    if name in ("ModelRouting", "RouteStore"):
        from gspo_megatron.routing import replay

        return getattr(replay, name)
    if name in ("routing_diagnostics", "route_drift"):
        from gspo_megatron.routing import diagnostics

        return getattr(diagnostics, name)
    raise AttributeError(name)
