"""Faster torch modules for Megatron's local layer spec (CPU, and GPUs without Transformer Engine):
attention, linear layers and rotary embeddings (:mod:`.local`), the MoE experts as grouped GEMMs
(:mod:`.moe`), attention over packed and context-parallel rows (:mod:`.row_attention`)."""
