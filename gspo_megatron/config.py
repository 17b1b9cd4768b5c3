"""The run's configuration: one typed dataclass per component, gathered in :class:`TrainConfig`.

A recipe is a YAML file whose top-level keys are the sections below; any field can be overridden
on the command line as ``--section.field=value``. See :mod:`gspo_megatron.config_loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gspo_megatron.algorithms import PolicyLossConfig
from gspo_megatron.model.config import ModelConfig, ParallelConfig, PrecisionConfig
from gspo_megatron.training.megatron_setup import OptimConfig


@dataclass
class DataConfig:
    """Where prompts come from."""

    source: Literal["arithmetic", "file"] = "arithmetic"
    """'arithmetic' = the built-in verifiable task (no download); 'file' = ``train_path``."""
    train_path: str | None = None
    """JSONL or Parquet prompts (verl and slime layouts work as-is)."""
    eval_path: str | None = None
    """Held-out prompts for accuracy evaluation (optional for 'file')."""
    prompt_key: str = "prompt"
    """Field holding the prompt (a string or a list of chat messages); dotted keys reach nested fields."""
    answer_key: str = "answer"
    """Field holding the reference answer, e.g. ``reward_model.ground_truth`` for verl."""
    num_train_examples: int = 500
    """Size of the built-in task's training set."""
    num_eval_examples: int = 120
    """Size of the built-in task's held-out set."""
    max_operand: int = 20
    """Built-in task: operands are drawn from [0, max_operand]."""
    heldout_fraction: float = 0.2
    """Built-in task: share of all problems reserved for evaluation (never trained on)."""
    max_prompt_length: int = 8
    """Prompts longer than this many tokens are rejected at load time."""


@dataclass
class TokenizerConfig:
    """How text becomes tokens."""

    kind: Literal["sentencepiece", "hf"] = "sentencepiece"
    """'sentencepiece' trains one in-process for the built-in task (saved with the run);
    'hf' loads a Hugging Face tokenizer (Qwen3)."""
    path: str | None = None
    """An existing tokenizer (sentencepiece .model / directory, or an HF name or directory)."""


@dataclass
class RolloutConfig:
    """Sampling G responses per prompt with Megatron-Core's inference engine."""

    group_size: int = 8
    """G: responses per prompt (the group advantages normalise within)."""
    prompts_per_step: int = 16
    """Prompts per RL step (per data-parallel rank); the rollout batch is prompts x G."""
    max_new_tokens: int = 4
    """Generation budget per response."""
    temperature: float = 1.0
    """Sampling temperature (also applied when the trainer scores tokens)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_batch_size: int = 256
    """Sequences the engine decodes at once."""


@dataclass
class RewardConfig:
    """Scoring responses."""

    fn: str = "arithmetic_exact"
    """A registered reward name or a dotted path ``package.module:function``."""
    timeout_s: float = 5.0
    """A reward call that takes longer scores 0 and is counted under ``reward/timeouts``."""


@dataclass
class SFTConfig:
    """Optional supervised warm-up before RL (the demo's tiny model starts from scratch)."""

    steps: int = 300
    """Optimiser steps of supervised training on prompt + answer (0 = skip)."""
    batch_size: int = 64
    """Sequences per SFT step."""
    lr: float = 3e-3
    """SFT learning rate (constant after a short warm-up)."""
    num_examples: int = 0
    """Warm up on only the first N training problems (0 = all); RL then also meets problems the
    warm-up never showed, so its gains must generalise rather than recall."""


@dataclass
class TrainerConfig:
    """The RL loop."""

    steps: int = 600
    """RL steps (each: rollout, reward, advantages, old log-probs, ``num_minibatches`` updates)."""
    num_minibatches: int = 4
    """Optimiser steps per rollout batch (the paper: 4)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation inside a minibatch)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """pi_old from a trainer forward pass, or the rollout engine's log-probs (paper Sec. 5.4)."""
    normalize_advantage_std: bool = True
    """Divide by the group std (GRPO/GSPO Eq. 6); False = mean-centred only."""
    reference_model: bool = False
    """Keep a frozen copy of the initial policy for a k3 KL penalty (needs ``loss.kl_coef`` > 0)."""
    eval_interval: int = 100
    """Held-out accuracy every N steps (0 = only before and after)."""
    seed: int = 1234
    """Seeds data order, sampling and initialisation."""
    max_consecutive_faults: int = 3
    """Steps in a row with NaN/Inf (rewards, advantages, log-probs, loss or gradients; each such step
    is skipped with the weights untouched) after which the run stops with an error."""


@dataclass
class RoutingConfig:
    """MoE routing replay and in-loop routing diagnostics (docs/routing.md)."""

    replay: Literal["none", "r2", "r3"] = "none"
    """'none' = free routing in every update forward; 'r2' = Routing Replay: the top-k experts
    recorded in the old-policy log-prob pass are forced in every forward and recompute of that
    batch's updates; 'r3' = routes recorded by the rollout engine (not available with Megatron's
    static/dynamic engines here: rejected at validation)."""
    diagnostics: bool = False
    """Log ``routing/*`` after every optimiser step: route change rate vs the old policy (overall,
    per MoE layer), top-k Jaccard overlap, router entropy, expert load and imbalance, |log ratio|
    and clip fraction of positions with and without a changed route. Costs one extra forward per
    minibatch (two with ``replay_gap``) on the steps it runs (``diagnostics_interval``). Every
    step (and every step with R2) also logs ``routing/drift/*`` for free: the routes each update
    forward takes vs the old policy's, after 0, 1, ... optimiser steps."""
    diagnostics_interval: int = 1
    """Run the diagnostics on RL steps whose index is a multiple of this (step 0 included). Their
    cost is a fixed number of forward passes, so the average step-time overhead divides by it
    (docs/benchmarks.md, CPU: 1.20x of the full RL step at 1, 1.01-1.02x at 8). Steps in between
    log only the free ``routing/drift/*``."""
    replay_gap: bool = True
    """With ``diagnostics``: also replay the old routes on the updated policy and log the gap to
    free routing (``routing/replay_gap_abs_logprob``, ``routing/replay_gap_k3``)."""


@dataclass
class CheckpointConfig:
    """Megatron ``dist_checkpointing`` (torch_dist) checkpoints."""

    save_dir: str | None = None
    """Where ``iter_XXXXXXX/`` and ``latest_checkpointed_iteration.txt`` go (None = run_dir/checkpoints)."""
    save_interval: int = 0
    """Save every N RL steps (0 = only at the end)."""
    load_dir: str | None = None
    """Resume from here (None = save_dir if it holds a checkpoint)."""
    keep_last: int = 2
    """Older checkpoints beyond this many are deleted."""
    init_weights: str | None = None
    """Initial policy weights (a dist checkpoint, e.g. converted from HF) when not resuming."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    run_dir: str = "runs/demo"
    """Run directory: metrics.jsonl, tokenizer, config, checkpoints."""
    wandb_project: str | None = None
    """Log to Weights & Biases (offline when no API key is set)."""
    progress: bool = True
    """One progress line per step on rank 0."""


@dataclass
class TrainConfig:
    """Everything a run needs. Sections mirror the YAML recipe's top-level keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        lr=3e-4, min_lr=3e-5, lr_warmup_steps=20, lr_decay_style="cosine"))
    # The embedded default is the CPU demo. Its responses are 2-3 tokens long, so a sequence ratio
    # is nearly a token ratio and the paper's eps (3e-4/4e-4, calibrated for responses of thousands
    # of tokens) clips most updates; the demo uses 1e-2 on both sides. Recipes for real models keep
    # the paper's values (PolicyLossConfig's defaults).
    loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(
        variant="gspo", clip_low=1e-2, clip_high=1e-2))
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
