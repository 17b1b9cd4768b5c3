"""Where a step's samples come from, framework-free (nothing here imports Megatron).

- :mod:`.source`: :class:`~.source.RolloutSource`, the one seam between the trainer's loop and
  the rollouts, with the colocated implementation (:class:`~.source.LocalRollouts`).
- :mod:`.sampling`: one step's prompts -> rollout -> reward -> advantages (dynamic sampling too).
- :mod:`.partial`: partial rollouts, the groups carried from step to step.
- :mod:`.remote`: rollouts on ranks of their own (``rollout.placement: separate``): the bridge, the
  weight channel, the trainer's end and the rollout ranks' server.
"""
