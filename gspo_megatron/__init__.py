"""gspo_megatron: GSPO / GRPO RL post-training for Megatron-Core Mixture-of-Experts models."""

__version__ = "0.1.0"
"""The package version: setup.py reads it from here, gspo-train --version prints it."""
