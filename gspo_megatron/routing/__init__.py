"""Routing statistics in plain torch (:mod:`gspo_megatron.routing.stats`; no Megatron import).

Recording and replaying routes on Megatron-Core's routers lives in the backend
(:mod:`gspo_megatron.backends.megatron.routing.replay`); see ``docs/routing.md``.
"""
