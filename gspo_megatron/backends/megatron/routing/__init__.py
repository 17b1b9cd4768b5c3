"""MoE routes on Megatron-Core's routers: record and replay (:mod:`.replay`), the routes the rollout
engine chose (R3, :mod:`.rollout_routes`), the in-loop drift diagnostics (:mod:`.diagnostics`) and
the per-run session that decides what each pass does (:mod:`.session`)."""
