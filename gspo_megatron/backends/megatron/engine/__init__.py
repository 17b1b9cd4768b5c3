"""The rollout engine on Megatron-Core's inference stack: :class:`~.rollout.RolloutEngine` (the
engine the trainer samples with), Megatron's dynamic context driven as a continuous-batching loop
(:mod:`.dynamic`, :mod:`.admission`), Megatron's inference classes subclassed (:mod:`.hooks`) and the
sampling copy in another dtype (:mod:`.sampling_copy`)."""
