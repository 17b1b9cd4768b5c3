"""Cross-section validation of a :class:`~gspo_megatron.config.TrainConfig`, before any compute.

Each section checks its own fields when it is built (:mod:`gspo_megatron.sections`);
:func:`validate_config` checks what involves several sections or the outside world (layout vs
world size, batch divisibility, lengths, routing vs the model, the KL penalty vs the reference
model, the model vs the converted checkpoint's model_config.json, paths, the reward function) and collects every problem into one :class:`ConfigError`
whose lines name the fields.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Sequence

from gspo_megatron.sections import FieldError, Section
from gspo_megatron.config.model import (ModelConfig, ModelFileError, ParallelConfig, architecture_differences,
                                        find_converted_dir, model_config_file,
                                        read_model_config_file, show_value)
from gspo_megatron.kv_budget import kv_budget_bytes, kv_bytes_per_token, kv_element_bytes
from gspo_megatron.config.schema import TrainConfig


class ConfigError(ValueError):
    """An invalid recipe, override or field combination. ``errors`` lists every problem found."""

    def __init__(self, errors: str | Sequence[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            msg = self.errors[0]
        else:
            msg = f"{len(self.errors)} configuration errors:\n" + "\n".join(
                f"  - {e}" for e in self.errors)
        super().__init__(msg)


class ConfigWarning(UserWarning):
    """A legal but probably unintended configuration."""


def _section_errors(cfg: TrainConfig) -> list[str]:
    """Each section's own checks again, for sections changed in place after construction."""
    errors: list[str] = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, Section):
            try:
                section.check()
            except FieldError as e:
                errors.extend(e.messages)
    return errors


def validate_config(cfg: TrainConfig, world_size: int = 1, *, check_paths: bool = True,
                    reward_search_dirs: Sequence[str] = ()) -> int:
    """Cross-section checks for a run on ``world_size`` ranks; return the data-parallel size.

    Needs nothing but ``cfg`` (no process group, model, tokenizer or file is built), so it runs
    before all of them. Raises one :class:`ConfigError` listing every problem, each naming the
    field(s) and values. ``check_paths=False`` skips the checks that files exist (to check a
    cluster recipe elsewhere). ``reward_search_dirs``: where else a ``module:function`` reward's
    module may live (the recipe's directory). Warns (:class:`ConfigWarning`) for legal but wasteful settings.
    The sections' own checks ran when they were built; they are repeated first (a field may have
    been changed in place), and the cross-section checks run only on consistent sections.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an int >= 1, got {world_size!r}")
    errors = _section_errors(cfg)
    if errors:
        raise ConfigError(errors)
    if trainer_world_size(cfg, world_size) < 1:
        raise ConfigError(_placement_errors(cfg, world_size, 0))
    dp, errors = layout_errors(cfg, world_size)
    errors += (_length_errors(cfg) + _routing_errors(cfg) + _loss_errors(cfg) + _offload_errors(cfg)
              + _start_weights_errors(cfg) + _path_errors(cfg, check_paths)
              + _reward_errors(cfg, reward_search_dirs) + _multi_turn_errors(cfg, reward_search_dirs))
    if errors:
        raise ConfigError(errors)
    return dp


def trainer_world_size(cfg: TrainConfig, world_size: int) -> int:
    """The ranks that train: the job's, less ``rollout.ranks`` under ``placement: separate``."""
    return world_size - cfg.rollout.ranks if cfg.rollout.placement == "separate" else world_size


def _placement_errors(cfg: TrainConfig, world_size: int, dp: int) -> list[str]:
    """Rollout ranks of ``placement: separate`` against the job and the trainer's layout."""
    ro = cfg.rollout
    if ro.placement != "separate":
        return []
    if ro.ranks >= world_size:
        return [f"rollout.ranks={ro.ranks} with rollout.placement='separate' leaves no rank to "
                f"train in a job of {world_size} ranks"]
    if dp and ro.ranks != dp:
        return [f"rollout.ranks={ro.ranks} must equal the trainer's data-parallel size ({dp}: "
                f"{world_size - ro.ranks} training ranks / TP x PP x CP): rollout rank j samples "
                f"data-parallel rank j's prompts"]
    return []


# Warnings are raised from the helpers below, two frames under validate_config's caller.
_WARN_LEVEL = 3


def parallel_layout_errors(par: ParallelConfig, model: ModelConfig, world_size: int, *,
                           rollout_engine: str = "auto") -> tuple[int, list[str]]:
    """The rule for which parallel layout runs, from the layout and the model alone: sizes that
    divide the world size, heads, experts and layers (:meth:`ParallelConfig.validate`), and what
    the rollout engine and context parallelism do not run. ``(data-parallel size or 0, errors)``.

    The one place this is decided: :func:`validate_config` (through :func:`layout_errors`),
    ``gspo-plan``'s check of a layout and its suggestions
    (:func:`gspo_megatron.planner.candidate_layouts`) all read it."""
    errors: list[str] = []
    dp = 0
    try:
        dp = par.validate(world_size, model)
    except ValueError as e:
        errors.append(str(e))
    pp, ep = par.pipeline_model_parallel_size, par.expert_model_parallel_size
    if pp > 1 and ep > 1:
        errors.append(
            f"parallel.pipeline_model_parallel_size={pp} with "
            f"parallel.expert_model_parallel_size={ep}: the rollout engine keeps expert-parallel "
            "ranks in lock-step with Megatron's dummy_forward, which has no pipeline send/recv; "
            "use one of them")
    # Context parallelism: every training row (every sequence of a packed row) is cut into 2 x CP
    # chunks (x TP under sequence parallel; ParallelConfig checks model.seq_length divides); what
    # does not shard that way yet is refused by name.
    cp = par.context_parallel_size
    if cp > 1:
        what = f"parallel.context_parallel_size={cp}"
        if pp > 1:
            errors.append(f"{what} with parallel.pipeline_model_parallel_size={pp}: not "
                          "validated; use PP 1")
        if rollout_engine == "static":
            errors.append(f"{what} with rollout.engine='static': rollouts under context "
                          "parallelism run on the dynamic engine (rollout.engine: auto)")
    return dp, errors


def layout_errors(cfg: TrainConfig, world_size: int) -> tuple[int, list[str]]:
    """Every check of :func:`validate_config` that a change of ``cfg.parallel`` can change, for a
    job of ``world_size`` ranks: :func:`parallel_layout_errors`, the rollout ranks of
    ``placement: separate``, the SFT batch over DP, the KV budget per TP x PP shard, the packed
    budget's rounding to TP x CP. ``(data-parallel size or 0, errors)``; no file is read.
    ``gspo-plan --config`` keeps only the suggestions with no error here."""
    trainer_world = trainer_world_size(cfg, world_size)
    if trainer_world < 1:
        return 0, _placement_errors(cfg, world_size, 0)
    dp, errors = parallel_layout_errors(cfg.parallel, cfg.model, trainer_world,
                                        rollout_engine=cfg.rollout.engine)
    errors += _placement_errors(cfg, world_size, dp)
    errors += (_batch_errors(cfg, dp, world_size) + _engine_errors(cfg) + _packing_errors(cfg)
               + invariant_errors(cfg))
    return dp, errors


def _batch_errors(cfg: TrainConfig, dp: int, world_size: int) -> list[str]:
    """The rollout batch (per DP rank) splits into minibatches, each into micro-batches; the SFT
    batch is global and splits evenly over the DP ranks."""
    ro, tr, sft, errors = cfg.rollout, cfg.trainer, cfg.sft, []
    batch = ro.prompts_per_step * ro.group_size
    if batch % tr.num_minibatches:
        errors.append(
            f"trainer.num_minibatches ({tr.num_minibatches}) must divide the rollout batch "
            f"rollout.prompts_per_step x rollout.group_size = {ro.prompts_per_step} x "
            f"{ro.group_size} = {batch}")
    elif token_budget(cfg) is None and (batch // tr.num_minibatches) % tr.micro_batch_size:
        errors.append(
            f"trainer.micro_batch_size ({tr.micro_batch_size}) must divide the minibatch "
            f"(rollout.prompts_per_step x rollout.group_size / trainer.num_minibatches = "
            f"{batch} / {tr.num_minibatches} = {batch // tr.num_minibatches})")
    if sft.steps > 0 and dp and sft.batch_size % dp:
        errors.append(f"sft.batch_size ({sft.batch_size}) must be divisible by the data-parallel "
                      f"size ({dp}: world size {world_size} / model parallelism)")
    return errors


def _length_errors(cfg: TrainConfig) -> list[str]:
    """Every prompt plus its longest response fits the model's context; DAPO's soft overlong
    penalty acts on the last ``overlong.buffer_tokens`` of the generation budget."""
    m, data, ro, errors = cfg.model, cfg.data, cfg.rollout, []
    if m.seq_length < data.max_prompt_length + ro.max_new_tokens:
        errors.append(
            f"model.seq_length ({m.seq_length}) must be >= data.max_prompt_length + "
            f"rollout.max_new_tokens = {data.max_prompt_length} + {ro.max_new_tokens} = "
            f"{data.max_prompt_length + ro.max_new_tokens}")
    if cfg.overlong.buffer_tokens > ro.max_new_tokens:
        errors.append(f"overlong.buffer_tokens ({cfg.overlong.buffer_tokens}) must be <= "
                      f"rollout.max_new_tokens ({ro.max_new_tokens}): the penalty ramps over the "
                      "last buffer_tokens tokens of the generation budget")
    return errors


def _engine_errors(cfg: TrainConfig) -> list[str]:
    """The rollout engine against the layout and its KV budget."""
    ro, par, m, errors = cfg.rollout, cfg.parallel, cfg.model, []
    if ro.partial_rollouts:
        why = {"rollout.engine='static'": ro.engine == "static",
               "dynamic_sampling.enabled": cfg.dynamic_sampling.enabled}
        errors += [f"rollout.partial_rollouts with {name}: partial rollouts run on the dynamic "
                   "engine, without dynamic sampling" for name, bad in why.items() if bad]
    if ro.partial_keep_kv and not ro.partial_rollouts:
        errors.append("rollout.partial_keep_kv needs rollout.partial_rollouts: it keeps the KV "
                      "cache of the responses a partial rollout carries")
    if ro.kv_cache_dtype == "fp8":
        why = {"rollout.engine='static'": ro.engine == "static",
               "rollout.decode_steps_per_sync=0": ro.decode_steps_per_sync == 0,
               f"parallel.pipeline_model_parallel_size={par.pipeline_model_parallel_size}":
                   par.pipeline_model_parallel_size > 1,
               f"parallel.expert_model_parallel_size={par.expert_model_parallel_size} with "
               f"rollout.decode_experts={ro.decode_experts!r}":
                   par.expert_model_parallel_size > 1 and ro.decode_experts != "replicated"}
        errors += [f"rollout.kv_cache_dtype='fp8' with {name}: the FP8 cache is written and read "
                   "by the dynamic engine's multi-step decoding step only (engine 'dynamic', "
                   "decode_steps_per_sync > 0, PP 1, decode_experts 'replicated' under EP), "
                   "never by Megatron's own attention" for name, bad in why.items() if bad]
    if ro.engine != "static" and ro.dynamic_buffer_size_gb is not None:
        bf16 = ro.precision in ("bf16", "fp8") or (ro.precision == "auto" and cfg.precision.bf16)
        need = kv_budget_bytes(1, m.seq_length, kv_bytes_per_token(
            m.num_layers, m.num_query_groups, m.kv_channels, par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            *kv_element_bytes(ro.kv_cache_dtype, 2 if bf16 else 4)))
        if ro.dynamic_buffer_size_gb * 1024 ** 3 < need:
            errors.append(
                f"rollout.dynamic_buffer_size_gb={ro.dynamic_buffer_size_gb} cannot hold one "
                f"request of model.seq_length={m.seq_length} tokens: it needs "
                f"{need / 1024 ** 3:.3g} GB of paged KV cache per rank")
    return errors


def invariant_errors(cfg: TrainConfig) -> list[str]:
    """``precision.batch_invariant`` against the layouts whose rollout and training forward
    cannot share one order of reduction: one line per blocking field. Tensor and context
    parallelism split a token's sums (vocabulary, heads, keys) over ranks, reduced by a
    collective whose order is the library's; pipeline parallelism and the engine paths through
    Megatron's forward (static engine, ``decode_steps_per_sync: 0``, sharded decoding experts)
    decode with kernels other than the step function's; Transformer Engine and Megatron's own
    modules are not the invariant kernels; other rollout numerics differ by design."""
    pr, par, ro = cfg.precision, cfg.parallel, cfg.rollout
    if not pr.batch_invariant:
        return []
    head = "precision.batch_invariant needs"
    blocked = {
        "precision.transformer_impl='transformer_engine'": pr.transformer_impl
        == "transformer_engine",
        f"precision.fp8={pr.fp8!r}": pr.fp8 is not None,
        "precision.local_kernels=false": pr.local_kernels is False,
        f"parallel.tensor_model_parallel_size={par.tensor_model_parallel_size}":
            par.tensor_model_parallel_size > 1,
        f"parallel.context_parallel_size={par.context_parallel_size}":
            par.context_parallel_size > 1,
        f"parallel.pipeline_model_parallel_size={par.pipeline_model_parallel_size}":
            par.pipeline_model_parallel_size > 1,
        f"parallel.expert_tensor_parallel_size={par.expert_tensor_parallel_size}":
            (par.expert_tensor_parallel_size or 1) > 1,
        "rollout.engine='static'": ro.engine == "static",
        "rollout.decode_steps_per_sync=0": ro.decode_steps_per_sync == 0,
        f"rollout.precision={ro.precision!r}": ro.precision not in (
            "auto", "bf16" if pr.bf16 else "fp32"),
        f"rollout.router_noise_std={ro.router_noise_std}": ro.router_noise_std > 0,
        "rollout.kv_cache_dtype='fp8'": ro.kv_cache_dtype != "auto",
        # (the invariant experts read their tile counts on the host: no graph can hold them)
        "rollout.decode_cuda_graphs=true": ro.decode_cuda_graphs,
        f"parallel.expert_model_parallel_size={par.expert_model_parallel_size} with "
        f"rollout.decode_experts={ro.decode_experts!r}": par.expert_model_parallel_size > 1
        and ro.decode_experts != "replicated",
    }
    return [f"{head} the local kernels, TP = CP = PP = 1 (expert TP 1), the dynamic engine's "
            f"step function for prefill and decoding (rollout.decode_experts='replicated' under "
            f"EP) and the trainer's numerics in the rollout; got {name}"
            for name, bad in blocked.items() if bad]


def _packing_blocker(cfg: TrainConfig) -> str | None:
    """Why this configuration cannot train packed microbatches, or None."""
    pr, par = cfg.precision, cfg.parallel
    if pr.local_kernels is False and pr.transformer_impl == "local":
        return ("needs an attention kernel that packs: precision.local_kernels=false keeps "
                "Megatron's local DotProductAttention, which refuses packed sequences; leave "
                "precision.local_kernels unset or use Transformer Engine")
    if cfg.routing.enabled and par.tensor_model_parallel_size > 1:
        return (f"with routing replay/diagnostics needs parallel.tensor_model_parallel_size=1, "
                f"got {par.tensor_model_parallel_size} (sequence-parallel shards of a packed "
                "row are not recorded)")
    return None


def token_budget(cfg: TrainConfig) -> int | None:
    """The token budget of the run's packed microbatches, or None for padded microbatches:
    ``trainer.max_tokens_per_microbatch`` when set; with ``trainer.pack_sequences`` (the
    default) and no budget, ``micro_batch_size x model.seq_length`` where packing can run
    (elsewhere padded, as before packing was the default)."""
    tr = cfg.trainer
    if tr.max_tokens_per_microbatch is not None:
        return tr.max_tokens_per_microbatch
    if not tr.pack_sequences or _packing_blocker(cfg) is not None:
        return None
    return tr.micro_batch_size * cfg.model.seq_length


def logprob_token_budget(budget: int | None, micro_batch_size: int,
                         logprob_micro_batch_size: int | None) -> int | None:
    """The packed token budget of the no-grad log-prob passes: the training ``budget`` scaled
    by ``logprob_micro_batch_size / micro_batch_size`` (``trainer.logprob_micro_batch_size``;
    the training budget when it is unset, None when not packing)."""
    if budget is None or logprob_micro_batch_size is None:
        return budget
    return budget * logprob_micro_batch_size // micro_batch_size


def _packing_errors(cfg: TrainConfig) -> list[str]:
    """Packed microbatches (``trainer.max_tokens_per_microbatch``) against the lengths, the
    attention kernel and routing replay."""
    tr, par, errors = cfg.trainer, cfg.parallel, []
    budget = tr.max_tokens_per_microbatch
    if budget is None:
        return errors
    if not tr.pack_sequences:
        return [f"trainer.max_tokens_per_microbatch={budget} is a packed microbatch's budget, "
                "but trainer.pack_sequences=false trains padded microbatches; unset one of them"]
    name = f"trainer.max_tokens_per_microbatch={budget}"
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    # A packed row is rounded up to SP x 2 CP (each sequence to 2 CP under context parallelism).
    cp = par.context_parallel_size
    shards = (par.tensor_model_parallel_size if par.sequence_parallel else 1) * (
        2 * cp if cp > 1 else 1)
    rounded = -(-longest // shards) * shards
    if rounded > budget:
        errors.append(f"{name} cannot hold the longest sequence the recipe allows: "
                      f"data.max_prompt_length + rollout.max_new_tokens = "
                      f"{cfg.data.max_prompt_length} + {cfg.rollout.max_new_tokens} = {longest}"
                      + (f" (rounded up to a multiple of {shards}: TP under sequence parallel"
                         " x 2 CP)" if shards > 1 else ""))
    scaled = logprob_token_budget(budget, tr.micro_batch_size, tr.logprob_micro_batch_size)
    if scaled < budget and rounded > scaled:  # (a smaller budget for the no-grad passes)
        errors.append(f"trainer.logprob_micro_batch_size={tr.logprob_micro_batch_size} "
                      f"scales {name} to {scaled} tokens for the log-prob passes, which "
                      f"cannot hold the longest sequence ({longest}); raise it to at least "
                      f"trainer.micro_batch_size={tr.micro_batch_size}")
    blocker = _packing_blocker(cfg)
    if blocker is not None:
        errors.append(f"{name} {blocker}; unset trainer.max_tokens_per_microbatch")
    return errors


def _routing_errors(cfg: TrainConfig) -> list[str]:
    """MoE routing replay and diagnostics against the engine, the model and the layout."""
    rt, m, par, tr, errors = cfg.routing, cfg.model, cfg.parallel, cfg.trainer, []
    if rt.enabled:
        what = f"routing.replay={rt.replay!r}" if rt.replay != "none" else "routing.diagnostics"
        if not any(m.layer_is_moe()):
            errors.append(f"{what} needs an MoE model (model.moe_layer_freq makes every layer "
                          "dense)")
        if rt.replay == "r2" and tr.old_logprobs == "rollout":
            warnings.warn("routing.replay='r2' with trainer.old_logprobs='rollout': the replayed "
                          "routes come from the trainer's recompute pass while pi_old comes from "
                          "the rollout engine", ConfigWarning, stacklevel=_WARN_LEVEL)
        ro = cfg.rollout
        if rt.replay == "r3" and ro.placement == "separate" and ro.max_staleness > 0:
            warnings.warn(f"routing.replay='r3' with rollout.max_staleness={ro.max_staleness}: "
                          "the replayed routes are those of the rollout's weights, up to "
                          f"{ro.max_staleness} optimizer steps older than the policy being "
                          "trained (docs/routing.md, staleness arms); routing.replay='r2' "
                          "replays the trainer's own", ConfigWarning, stacklevel=_WARN_LEVEL)
    return errors


def _loss_errors(cfg: TrainConfig) -> list[str]:
    """The mismatch correction against where pi_old comes from; the KL penalty and its reference
    model."""
    loss, tr, errors = cfg.loss, cfg.trainer, []
    # Mismatch correction weighs by pi_old / pi_rollout: with pi_old taken from the rollout
    # engine (paper Sec. 5.4) every weight is 1.
    if cfg.rollout_correction.enabled and tr.old_logprobs == "rollout":
        warnings.warn(f"rollout_correction.mode={cfg.rollout_correction.mode!r} with "
                      "trainer.old_logprobs='rollout': pi_old is the rollout engine's own "
                      "log-prob, so every correction weight is 1 and the correction does nothing",
                      ConfigWarning, stacklevel=_WARN_LEVEL)
    if loss.kl_coef > 0 and not tr.reference_model:
        errors.append(f"loss.kl_coef = {loss.kl_coef} > 0 needs trainer.reference_model: true "
                      "(the k3 KL penalty needs the reference policy's log-probs)")
    if tr.reference_model and loss.kl_coef == 0:
        warnings.warn("trainer.reference_model is true but loss.kl_coef is 0: the reference "
                      "copy costs memory and a forward pass per step for nothing",
                      ConfigWarning, stacklevel=_WARN_LEVEL)
    return errors


def _offload_errors(cfg: TrainConfig) -> list[str]:
    """Offloading the training state during rollouts needs rollouts on the training ranks."""
    if cfg.trainer.offload != "none" and cfg.rollout.placement == "separate":
        return [f"trainer.offload={cfg.trainer.offload!r} with rollout.placement='separate': the "
                "training ranks never roll out, so there is no rollout to make room for; use "
                "trainer.offload: none"]
    return []


def _start_weights_errors(cfg: TrainConfig) -> list[str]:
    """The model against the converted checkpoint it starts from (load_config took the model from
    its model_config.json; this catches a config built in Python or changed in place)."""
    model_file = model_config_file(cfg.checkpoint.init_weights)
    if model_file is None:
        return []
    try:
        reference = ModelConfig(**read_model_config_file(model_file))
    except ModelFileError as e:
        return list(e.errors)
    return [f"model.{field}: the config says {show_value(mine)}, {model_file} says "
            f"{show_value(theirs)}"
            for field, mine, theirs in architecture_differences(cfg.model, reference)]


def _path_errors(cfg: TrainConfig, check_paths: bool) -> list[str]:
    """Files the run reads exist; the export directory is new and has a converted source."""
    data, ck, errors = cfg.data, cfg.checkpoint, []
    if check_paths:
        for name, value in (("data.train_path", data.train_path if data.source == "file" else None),
                            ("data.eval_path", data.eval_path),
                            ("checkpoint.init_weights", ck.init_weights),
                            ("checkpoint.load_dir", ck.load_dir)):
            if value and not os.path.exists(value):
                errors.append(f"{name}: no such {'file' if name.startswith('data') else 'path'} "
                              f"{value!r}")
    if ck.export_hf:
        if os.path.isfile(ck.export_hf) or (os.path.isdir(ck.export_hf) and os.listdir(ck.export_hf)):
            errors.append(f"checkpoint.export_hf: {ck.export_hf!r} exists and is not an empty "
                          "directory")
        elif not ck.init_weights or (check_paths and find_converted_dir(ck.init_weights) is None):
            errors.append("checkpoint.export_hf needs checkpoint.init_weights to be a "
                          "gspo-convert-hf directory (or a run that started from one): it "
                          "supplies the Hugging Face config and tokenizer files")
    return errors


def _multi_turn_errors(cfg: TrainConfig, search_dirs: Sequence[str]) -> list[str]:
    """The environment class resolves, on a rollout path that runs turns: the dynamic engine,
    colocated, without partial rollouts."""
    mt, ro = cfg.multi_turn, cfg.rollout
    if not mt.enabled:
        return []
    errors = []
    try:
        from gspo_megatron.envs.workers import resolve_env_class
        resolve_env_class(mt.env, search_dirs)
    except (ValueError, ImportError) as e:
        errors.append(str(e))
    for field_name, value, bad in (("rollout.engine", ro.engine, ro.engine == "static"),
                                   ("rollout.placement", ro.placement, ro.placement != "colocated"),
                                   ("rollout.partial_rollouts", ro.partial_rollouts,
                                    ro.partial_rollouts),
                                   # (turns decode through Megatron's forward, per step)
                                   ("precision.batch_invariant", cfg.precision.batch_invariant,
                                    cfg.precision.batch_invariant)):
        if bad:
            errors.append(f"multi_turn.env is set: {field_name}={value!r} is not supported with "
                          "multi-turn rollouts yet (the dynamic engine, colocated, without "
                          "partial rollouts)")
    return errors


def _reward_errors(cfg: TrainConfig, search_dirs: Sequence[str]) -> list[str]:
    """The reward function (or every reward of ``reward.fns``) resolves (imported lazily:
    resolving may import the user's module); a mix naming the reward model has its path."""
    from gspo_megatron.rewards import get_reward_fn
    from gspo_megatron.rewards.reward_model import REWARD_MODEL

    errors = []
    names = [("reward.fn", cfg.reward.fn)] if cfg.reward.fns is None else [
        (f"reward.fns.{name}", name) for name in cfg.reward.fns]
    for field_name, name in names:
        if name == REWARD_MODEL:
            path = cfg.reward_model.path
            if not path or not os.path.isdir(path):
                errors.append(f"{field_name}: reward_model.path must be the directory of a "
                              f"Hugging Face reward model, got {path!r}")
            continue
        try:
            get_reward_fn(name, search_dirs)
        except (ValueError, ImportError) as e:
            errors.append(f"{field_name} = {name!r}: {e}")
    if cfg.reward.fns is not None and cfg.multi_turn.enabled:
        errors.append("reward.fns with multi_turn.env: a multi-turn episode's reward is its "
                      "environment's")
    return errors
