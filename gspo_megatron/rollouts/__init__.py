"""Where a step's samples come from, framework-free (nothing here imports Megatron).

- :mod:`.source`: :class:`~.source.RolloutSource`, the one seam between the trainer's loop and
  the rollouts, with the colocated implementation (:class:`~.source.LocalRollouts`).
- :mod:`.sampling`: one step's prompts -> rollout -> reward -> advantages (dynamic sampling too).
- :mod:`.partial`: partial rollouts, the groups carried from step to step.
- :mod:`.remote`: rollouts on ranks of their own (``rollout.placement: separate``): the bridge, the
  trainer's end and the rollout ranks' server.
- :mod:`.weight_channel`: the weights from every trainer rank's host memory to the rollout ranks,
  shard by shard in buckets (nothing posted on a trainer GPU).
"""
