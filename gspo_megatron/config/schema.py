"""The run's configuration: one typed dataclass per component, gathered in :class:`TrainConfig`.

A recipe is a YAML file whose top-level keys are the sections below; any field can be overridden
on the command line as ``--section.field=value``. See :mod:`gspo_megatron.config.loader`.

The defaults are the paper's and production's: a recipe that leaves a section out fine-tunes a
pretrained model with them (GSPO eps 3e-4 / 4e-4, a constant 1e-6 learning rate, no supervised
warm-up). The exceptions are the sections that only a recipe can choose, whose defaults are the
built-in task's: the model (the ``tiny`` shape), and data / tokenizer / reward (the arithmetic
task). The CPU demo's toy values live in its recipe, ``gspo_megatron/config/recipes/demo.yaml``.
Each section checks its own fields when constructed (:class:`~gspo_megatron.sections.Section`); checks across
sections are :func:`~gspo_megatron.config.validation.validate_config`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from gspo_megatron.algorithms.dapo import DynamicSamplingConfig, OverlongConfig
from gspo_megatron.algorithms.policy_loss import PolicyLossConfig
from gspo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig
from gspo_megatron.sections import Problem, Section
from gspo_megatron.config.model import ModelConfig, ParallelConfig, PrecisionConfig
from gspo_megatron.config.rollout import RolloutConfig


@dataclass
class OptimConfig(Section, name="optim"):
    """Optimiser and LR schedule (Megatron's names). Defaults: RL fine-tuning of a pretrained model
    (verl's and slime's: AdamW at a constant 1e-6, no warm-up, weight decay 0.01, clip 1.0)."""

    lr: float = 1e-6
    """Peak learning rate (1e-6 suits RL on a pretrained model; the from-scratch demo uses 3e-4)."""
    min_lr: float = 0.0
    """Floor of the decay (unused with ``lr_decay_style: constant``)."""
    lr_warmup_steps: int = 0
    """Optimiser steps of linear warm-up from 0."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over ``lr_decay_steps`` (constant = the peak throughout)."""
    lr_decay_steps: int | None = None
    """Steps over which to decay; None = the run's total optimiser steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    override_opt_param_scheduler: bool = False
    """On resume, follow this config's LR / weight-decay schedule from the checkpoint's step on
    (Megatron-LM's ``--override-opt_param-scheduler``). False: a resume whose schedule differs
    from the checkpoint's (another ``optim.lr``, warm-up or decay, or another ``trainer.steps``
    when ``lr_decay_steps`` is null) is refused before anything runs, naming the field;
    megatron-core would silently keep the checkpoint's, e.g. decay to ``min_lr`` at the old
    run's last step and train at the floor from there."""

    def validate(self) -> None:
        """Re-run the checks (after changing a field in place); raises ``FieldError``."""
        self.check()

    def _problems(self) -> Iterator[Problem]:
        yield from self._positive("lr", "adam_eps")
        yield from self._at_least(0, "min_lr", "lr_warmup_steps", "weight_decay", "clip_grad")
        yield from self._at_least(1, "lr_decay_steps", note=" or null")
        if self.lr > 0 and self.min_lr > self.lr:
            yield self._problem(("min_lr", "lr"), f"must be <= optim.lr ({self.lr}), got {self.min_lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                yield self._problem(name, f"must be in [0, 1), got {getattr(self, name)}")


@dataclass
class DataConfig(Section, name="data"):
    """Where prompts come from (default: the built-in arithmetic task, which needs no download)."""

    source: Literal["arithmetic", "arithmetic_chain", "file"] = "arithmetic"
    """'arithmetic' = the built-in verifiable task (no download); 'arithmetic_chain' = its long
    form (``chain_operands`` operands, the answer worked out step by step, ~35 tokens for 6
    single-digit operands; the routing study's task); 'file' = ``train_path``."""
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
    seed: int | None = None
    """Built-in tasks: seed of the generated problem sets (null = ``trainer.seed``). Set it to vary
    the RL seed over the same problems (the routing study's seeds)."""
    chain_operands: int = 6
    """'arithmetic_chain': operands per problem (the answer has ``chain_operands - 1`` steps)."""
    heldout_fraction: float = 0.2
    """Built-in task: share of all problems reserved for evaluation (never trained on)."""
    max_prompt_length: int = 1024
    """Prompts longer than this many tokens are rejected at load time (with
    ``rollout.max_new_tokens``, it bounds ``model.seq_length`` from below)."""

    def _problems(self) -> Iterator[Problem]:
        if self.source == "file" and not self.train_path:
            yield self._problem(("train_path", "source"), "is required when data.source is 'file'")
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name):
                yield self._problem(name, "must be a non-empty field name")
        yield from self._at_least(1, "max_prompt_length")
        if self.source != "file":
            # Checked for the built-in tasks only, so each problem names source too (the loader
            # drops it when source did not parse and holds its default).
            for fields, text in self._builtin_task_problems():
                yield (*fields, "source"), text

    def _builtin_task_problems(self) -> Iterator[Problem]:
        """The built-in tasks' knobs."""
        yield from self._at_least(1, "num_train_examples", "max_operand")
        yield from self._at_least(2, "chain_operands")
        yield from self._at_least(0, "seed", note=" or null")
        yield from self._at_least(0, "num_eval_examples")
        if not 0.0 < self.heldout_fraction < 1.0:
            yield self._problem("heldout_fraction", f"must be in (0, 1), got {self.heldout_fraction}")


@dataclass
class TokenizerConfig(Section, name="tokenizer"):
    """How text becomes tokens."""

    kind: Literal["sentencepiece", "hf"] = "sentencepiece"
    """'sentencepiece' trains one in-process for the built-in task (saved with the run);
    'hf' loads a Hugging Face tokenizer (Qwen3)."""
    path: str | None = None
    """An existing tokenizer (sentencepiece .model / directory, or an HF name or directory)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments to the HF chat template, as verl's ``data.apply_chat_template_kwargs``
    and vLLM's ``chat_template_kwargs`` (Qwen3: ``{enable_thinking: false}`` drops the
    ``<think>`` block): the same prompt tokens in rollouts, evaluation, the supervised warm-up
    and the prompt-length checks; saved with the run's tokenizer. HF tokenizers only."""

    def _problems(self) -> Iterator[Problem]:
        if self.chat_template_kwargs and self.kind != "hf":
            yield self._problem(("chat_template_kwargs", "kind"), (
                f"applies to a Hugging Face chat template (tokenizer.kind: hf), got kind "
                f"{self.kind!r}"))
        if self.kind == "hf" and not self.path:
            yield self._problem(("path", "kind"), (
                "is required when tokenizer.kind is 'hf' (a Hugging Face name such as "
                "'Qwen/Qwen3-30B-A3B' or a directory)"))


@dataclass
class RewardConfig(Section, name="reward"):
    """Scoring responses."""

    fn: str = "arithmetic_exact"
    """A registered reward name or a dotted path ``package.module:function``."""
    timeout_s: float = 5.0
    """A reward call that takes longer scores 0 and is counted under ``reward/timeouts``."""
    num_workers: int = 2
    """Worker processes per rank that score rewards: calls run in parallel, and a call past
    ``timeout_s`` is stopped by killing its worker (replaced at once). 0 = threads in the trainer's
    process (a hung call cannot be stopped, only counted in ``reward/hung_threads``). Rewards
    registered as cheap (arithmetic_exact, math_exact, format_boxed) always run inline."""
    fns: dict[str, float] | None = None
    """A weighted mix in place of ``fn``: ``{name: weight}``, each name a registered reward, a
    dotted ``module:function`` or ``reward_model`` (the ``reward_model`` section's model); the
    reward is ``sum w * r``, each component's mean logged as ``reward/component/{name}``. Such a
    mix scores in threads of the trainer (``num_workers`` is not used), the reward model in its
    own process."""

    def _problems(self) -> Iterator[Problem]:
        if not self.fn:
            yield self._problem("fn", "must name a reward function")
        if self.fns is not None:
            if not self.fns:
                yield self._problem("fns", "must name at least one reward (or be null)")
            for name, weight in self.fns.items():
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    yield self._problem("fns", f"weight of {name!r} must be a number, got "
                                        f"{weight!r}")
        yield from self._positive("timeout_s")
        yield from self._at_least(0, "num_workers")


@dataclass
class RewardModelConfig(Section, name="reward_model"):
    """A Hugging Face sequence-classification reward model (one output, a Bradley-Terry scalar
    head), used where ``reward.fns`` names ``reward_model``; run in a process of its own."""

    path: str = ""
    """Directory of an ``AutoModelForSequenceClassification`` with ``num_labels: 1`` and its
    tokenizer (whose chat template formats the scored conversation)."""
    batch_size: int = 16
    """Conversations per forward."""
    max_length: int = 4096
    """Tokens per conversation at most (cut from the left: the response's end is kept)."""
    device: str = "cpu"
    """Where the reward model runs (``cpu``, or a GPU of its own such as ``cuda:1``)."""
    timeout_s: float = 600.0
    """A batch of the step's scores that takes longer scores 0 (counted in ``reward/errors``)
    and the reward model's process is started again."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(1, "batch_size", "max_length")
        yield from self._positive("timeout_s")


@dataclass
class MultiTurnConfig(Section, name="multi_turn"):
    """Multi-turn rollouts: each response is an episode with an environment (tools, a user
    simulator) that answers every assistant turn. Off while ``env`` is empty. The episode's
    token budget (policy and environment tokens together) is ``rollout.max_new_tokens``."""

    env: str = ""
    """The environment: a built-in name (``tool_arithmetic``) or ``package.module:Class``
    (``reset(example) -> messages``, ``step(assistant_message) -> (messages, reward | None,
    done)``; docs/multi-turn.md). Its reward is the episode's (``reward.fn`` is not called)."""
    max_turns: int = 4
    """Assistant turns per episode at most; an episode the environment has not ended by then is
    cut (reward 0, ``env/max_turns_cut``)."""
    max_turn_tokens: int = 256
    """Policy tokens per assistant turn at most; a turn that reaches it ends the episode
    (reward 0, ``env/turn_budget_cut``)."""
    max_message_chars: int = 4000
    """An environment message longer than this is cut to it (``env/truncated_messages``)."""
    num_workers: int = 2
    """Worker processes per rank running the environments (an episode stays in one); 0 = in the
    trainer's process, without timeouts."""
    timeout_s: float = 10.0
    """An environment call (``reset``, ``step``) that takes longer is stopped by killing its
    worker: that episode and the others the worker held end with reward 0 (``env/timeouts``)."""

    @property
    def enabled(self) -> bool:
        return bool(self.env)

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(1, "max_turns", "max_turn_tokens", "max_message_chars")
        yield from self._at_least(0, "num_workers")
        yield from self._positive("timeout_s")


@dataclass
class SFTConfig(Section, name="sft"):
    """Optional supervised warm-up before RL: off by default (a pretrained policy needs none); the
    demo's tiny model, trained from scratch, uses 300 steps."""

    steps: int = 0
    """Optimiser steps of supervised training on prompt + answer (0 = skip)."""
    batch_size: int = 64
    """Sequences per SFT step (across data-parallel ranks: divisible by the DP size)."""
    lr: float = 1e-5
    """SFT learning rate (constant after a short warm-up); 1e-5 suits a pretrained model."""
    num_examples: int = 0
    """Warm up on only the first N training problems (0 = all); RL then also meets problems the
    warm-up never showed, so its gains must generalise rather than recall."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "steps", "num_examples")
        yield from self._at_least(1, "batch_size")
        yield from self._positive("lr")


OFFLOAD_PARTS = {"none": (), "optimizer": ("optimizer",), "optimizer+grads": ("optimizer", "grads"),
                 "all": ("optimizer", "grads", "main")}
"""What each ``trainer.offload`` setting moves to host memory during rollouts (read by the
policy, :mod:`gspo_megatron.backends.megatron.offload`, and by the planner)."""


@dataclass
class TrainerConfig(Section, name="trainer"):
    """The RL loop."""

    steps: int = 600
    """RL steps (each: rollout, reward, advantages, old log-probs, ``num_minibatches`` updates)."""
    num_minibatches: int = 4
    """Optimiser steps per rollout batch (the paper: 4)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation inside a minibatch) of padded
    microbatches, each right-padded to the batch's longest sequence; with packing (the default)
    it sizes the token budget (``max_tokens_per_microbatch``)."""
    logprob_micro_batch_size: int | None = None
    """Sequences per forward of the no-grad log-prob passes (old policy, reference model);
    None: ``micro_batch_size``. Packed, their token budget is ``max_tokens_per_microbatch x
    logprob_micro_batch_size / micro_batch_size``. They keep no activations for a backward, so
    larger microbatches fit and cost fewer per-call overheads (TRL's workload: 3 packed -> 1,
    15.3 -> 12.5 ms). verl's ``log_prob_micro_batch_size_per_gpu`` / ``_max_token_len_per_gpu``."""
    pack_sequences: bool = True
    """Padding-free training (the default): the sequences of every old-log-prob, update and SFT
    pass are packed (concatenated, Megatron's ``thd`` ``PackedSeqParams``: no attention across
    sequences, rotary positions restart per sequence) into microbatches of at most
    ``max_tokens_per_microbatch`` tokens, so compute follows the real tokens instead of
    ``batch x longest`` (verl's ``use_remove_padding``). Where packing cannot run (Megatron's
    local attention with ``precision.local_kernels: false``; routing replay or diagnostics at
    TP > 1) the run trains padded microbatches, as with False (the opt-out: padded microbatches of
    ``micro_batch_size`` sequences)."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of a packed microbatch. None: ``micro_batch_size x model.seq_length``, what a
    padded microbatch of the run holds (the same activation memory, every token real). Must hold
    the longest sequence (``data.max_prompt_length + rollout.max_new_tokens``). verl's
    ``ppo_max_token_len_per_gpu``. Set with ``pack_sequences: false`` it is refused."""
    balance_data_parallel: bool = True
    """With packing (``pack_sequences``) and data parallelism: after the advantages, whole samples move between the
    data-parallel ranks so each trains about the same tokens in every minibatch (the minibatches
    keep their sequences, so the gradient is unchanged; ``perf/dp_token_imbalance``). Without it
    every rank trains the responses it sampled, and the rank with the longest ones sets the pace
    (verl's ``trainer.balance_batch``). No effect on padded microbatches or at DP = 1."""
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
    gc_freeze: bool = True
    """Take the objects set-up built (and the first step's: the engine's tables) out of Python's
    garbage collector's scans (``gc.freeze``, as vLLM after start-up): a full collection then
    walks only what the run made since, instead of ~0.4 s over every module and library at a
    moment the allocations pick (measured inside a partial rollout: 23 % of its time).
    ``perf/gc_s`` logs the collector's seconds per step either way."""
    offload: Literal["none", "optimizer", "optimizer+grads", "all"] = "none"
    """Training state moved off the GPU while this rank rolls out (``rollout.placement:
    colocated``), so its memory holds the rollout engine's KV cache instead: before each step's
    rollout it is copied to pinned host memory and its GPU storage freed; after the rollout it is
    copied back into the same tensors (same addresses inside the tensors' storage, values
    bitwise), before the old-log-prob pass and the updates. ``optimizer``: Adam's moments;
    ``optimizer+grads``: and DDP's fp32 gradient buffers; ``all``: and the optimizer's fp32
    main copy of the weights (bf16 training; with fp32 training the main copy is the weights,
    which the rollout reads, and stays). verl's ``actor_rollout_ref.actor.megatron.
    optimizer_offload`` / ``grad_offload`` (``param_offload`` moves the weights too), slime's
    ``--offload`` (torch_memory_saver). ``gspo-plan`` counts the rollout peak without the moved
    state. Costs two host copies of it per step (PCIe: ~25 GB/s each way)."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "steps", "eval_interval", "seed")
        yield from self._at_least(1, "num_minibatches", "micro_batch_size",
                                  "max_consecutive_faults")
        if self.max_tokens_per_microbatch is not None:
            yield from self._at_least(1, "max_tokens_per_microbatch")
        if self.logprob_micro_batch_size is not None:
            yield from self._at_least(1, "logprob_micro_batch_size")


@dataclass
class EvaluationConfig(Section, name="evaluation"):
    """Held-out evaluation. Greedy accuracy (``eval/accuracy``) always runs when there is a
    held-out set (``data.eval_path``, or the built-in task's); sampled evaluation adds mean@n and
    pass@k (Chen et al. 2021, arXiv 2107.03374: the unbiased estimator from n samples) at the same
    times: before RL, every ``trainer.eval_interval`` steps, after RL."""

    num_samples: int = 0
    """Default 0 (greedy only). n > 0: sample n responses per held-out prompt and log
    ``eval/mean@n`` (mean correctness of all samples) and ``eval/pass@k`` for k = 1, 2, 4, ..., n
    (unbiased estimator). DeepSeek-R1 reports pass@1 from 64 samples (arXiv 2501.12948, Sec. 3);
    the cost is n times the greedy evaluation's decoding."""
    temperature: float = 0.6
    """Default 0.6: sampling temperature of the sampled evaluation (DeepSeek-R1's and Qwen3's
    recommended evaluation setting, with ``top_p`` 0.95)."""
    top_p: float = 0.95
    """Default 0.95: nucleus threshold in (0, 1] of the sampled evaluation (1.0 = off)."""
    seed: int = 0
    """Default 0: seed of the sampled evaluation (the same samples at every resume)."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "num_samples", note=" (0 = greedy evaluation only)")
        yield from self._at_least(0, "seed")
        if not self.temperature > 0:
            yield self._problem("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            yield self._problem("top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass
class RoutingConfig(Section, name="routing"):
    """MoE routing replay and in-loop routing diagnostics (docs/routing.md)."""

    replay: Literal["none", "r2", "r3"] = "none"
    """'none' = free routing in every update forward; 'r2' = Routing Replay: the top-k experts
    recorded in the old-policy log-prob pass are forced in every forward and recompute of that
    batch's updates; 'r3' = Rollout Routing Replay (arXiv 2510.11370): the experts the rollout
    engine chose while sampling (prefill and every decode step, recorded from the dynamic
    engine's packed buffer) are forced in the old-log-prob pass and in every update forward;
    positions the engine never forwarded (each response's last token, padding) route freely. Logs
    the rollout-vs-trainer route disagreement (``routing/rollout/*``) every step."""
    diagnostics: bool = False
    """Log ``routing/*`` after every optimiser step: route change rate vs the old policy (overall,
    per MoE layer), top-k Jaccard overlap, router entropy, expert load and imbalance, |log ratio|
    and clip fraction of positions with and without a changed route. Also records the rollout
    engine's routes and logs, every step, where they differ from the trainer's old-policy routes
    (``routing/rollout/*``: per layer, share of tokens, |log p_train - log p_rollout| with and
    without a differing route; no extra forward). Costs one extra forward per
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

    @property
    def records_rollout_routes(self) -> bool:
        """Whether the rollout engine records its routes: R3 replays them, the diagnostics compare
        them with the trainer's (``routing/rollout/*``)."""
        return self.replay == "r3" or self.diagnostics

    @property
    def enabled(self) -> bool:
        """Whether the RL loop touches routes at all (replay, or the diagnostics)."""
        return self.replay != "none" or self.diagnostics

    def diagnoses(self, step: int) -> bool:
        """Whether RL step ``step`` runs the diagnostics (every ``diagnostics_interval`` steps)."""
        return self.diagnostics and step % self.diagnostics_interval == 0

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(1, "diagnostics_interval", note=(
            " (run the diagnostics every N RL steps)"))


@dataclass
class CheckpointConfig(Section, name="checkpoint"):
    """Megatron ``dist_checkpointing`` (torch_dist) checkpoints."""

    save_dir: str | None = None
    """Where ``iter_XXXXXXX/`` and ``latest_checkpointed_iteration.txt`` go (None = run_dir/checkpoints)."""
    save_interval: int = 0
    """Save every N RL steps (0 = only at the end)."""
    load_dir: str | None = None
    """Resume from here (None = save_dir if it holds a checkpoint)."""
    keep_last: int = 2
    """Older checkpoints beyond this many are deleted."""
    async_save: bool = True
    """Write checkpoints in the background (Megatron-LM's ``--async-save``): the step pays for
    building the state dict and forking the writer; the write overlaps the next step's rollout,
    and the checkpoint is committed (renamed, made the latest) before that step's first update.
    False writes and commits inside the step."""
    init_weights: str | None = None
    """Initial policy weights when not resuming: a ``gspo-convert-hf`` output directory or a run's
    ``sft_weights``. A converted directory's ``model_config.json`` then defines the model's
    architecture: the recipe need not restate it, and any architecture field it does set must
    agree (refused before anything runs, naming the field and both values)."""

    export_hf: str | None = None
    """After the last step, export the final policy to this Hugging Face directory (rank 0, one
    ``gspo-export-hf`` process: the model once in host memory, in the source dtype, config and
    tokenizer files carried). Needs ``init_weights`` to be a ``gspo-convert-hf`` directory (it
    knows the HF config); must not be a non-empty directory. Not written after a stop signal."""

    allow_pickle: bool = False
    """Read a checkpoint's per-rank rollout state with a full unpickle when it is not plain data
    (written by a gspo-train before the plain format). A pickle can run code when loaded: set it
    only for checkpoints you wrote yourself. Off: such a checkpoint is refused in one line before
    anything runs. Everything else in a checkpoint is read with ``weights_only=True``."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "save_interval", note=" (0 = only at the end)")
        yield from self._at_least(1, "keep_last")


@dataclass
class LoggingConfig(Section, name="logging"):
    """Where metrics go."""

    run_dir: str = "runs/gspo"
    """Run directory: metrics.jsonl, tokenizer, config, checkpoints."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project: online when the user is logged in
    (``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes), else offline (kept in the run
    directory's ``wandb/`` for ``wandb sync``); ``WANDB_MODE`` wins. One line at the start says
    which."""
    tensorboard_dir: str | None = None
    """Default null (off). A directory: every metric of every step also written there as a
    TensorBoard scalar at its step, by the logging rank (Megatron-LM's ``--tensorboard-dir``; needs
    ``pip install tensorboard``, a warning and no events without it). A resumed run hides the
    steps it redoes from TensorBoard's readers (``purge_step``), as ``metrics.jsonl`` drops them.
    One directory per run; ``tensorboard --logdir`` on their parent shows runs side by side."""
    progress: bool = True
    """Show the progress of the warm-up, the RL steps (one line per step), evaluation, with an
    ETA: a live line on a terminal, plain lines otherwise (gspo_megatron/progress.py). On the
    logging rank only."""
    memory_profile_steps: int = 0
    """CUDA: record the caching allocator's history over the first N RL steps, then write
    ``<run_dir>/memory_profile.json``: the peak of allocated memory and what is live at it,
    grouped by the code that allocated it (gspo_megatron/memory_profile.py), to read a measured
    peak against ``gspo-plan``'s. 0 = off; on CPU off with one log line."""

    def _problems(self) -> Iterator[Problem]:
        if not self.run_dir:
            yield self._problem("run_dir", "must be a non-empty path")
        yield from self._at_least(0, "memory_profile_steps")
        if self.tensorboard_dir is not None and not self.tensorboard_dir:
            yield self._problem("tensorboard_dir", "must be a non-empty path or null (off)")


@dataclass
class TrainConfig:
    """Everything a run needs. Sections mirror the YAML recipe's top-level keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # GSPO with the paper's eps (clip_low / clip_high None = 3e-4 / 4e-4, Sec. 5.1). The section is
    # owned (and checked on construction) by gspo_megatron.algorithms.policy_loss.
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # Rollout/training mismatch correction (off by default): importance weights pi_old /
    # pi_rollout, truncated or masked; owned by gspo_megatron.algorithms.rollout_correction.
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # DAPO's dynamic sampling and overlong handling (both off by default); owned by
    # gspo_megatron.algorithms.dapo.
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
