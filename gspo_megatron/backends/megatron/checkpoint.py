"""Training checkpoints in Megatron's layout, written with ``dist_checkpointing`` (torch_dist).

    <save_dir>/
        iter_0000010/                      one checkpoint: model + optimizer shards, common state
            rng/rank_00000.pt              per-rank RNG states (tensors and ints only)
            rank/rank_00000.pt             per-rank rollouts in flight (plain data: .plain_state)
        latest_checkpointed_iteration.txt  "10", written last
        reference_weights/                 trainer.reference_model: the policy RL started from
                                           (model weights only, written at step 0)

Crash safety: a checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed into place only when every
rank has finished, and the pointer file is replaced atomically after that; a run killed mid-write
leaves the previous checkpoint and pointer intact. ``keep_last`` prunes older checkpoints.
Loading falls back to the newest older checkpoint when the latest one cannot be read.

Nothing is unpickled beyond tensors, numbers, strings and containers (``weights_only=True``).
Per-rank state written before it was plain data is read only with ``checkpoint.allow_pickle``
(a full unpickle: for checkpoints you wrote yourself).
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from gspo_megatron.policy import RANK_STATE_KEY

from . import plain_state

if TYPE_CHECKING:
    from .checkpoint_writer import AsyncCheckpointWriter

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# The key under which save_checkpoint nests the model's sharded state dict. Nesting does not change
# the ShardedTensor keys (the model's own, no prefix), only where the loaded tensors come back.
TRAINING_MODEL_KEY = "model"
# Written by dist_checkpointing.save into every checkpoint directory.
_DIST_METADATA = "metadata.json"
_ITER_RE = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory and the reason."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that only a full unpickle reads (and ``checkpoint.allow_pickle`` is
    off): refused, never tried on an older checkpoint."""


def iteration_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def list_checkpoints(save_dir: str) -> list[int]:
    """Complete checkpoints (renamed into place) in ``save_dir``, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    steps = [int(m.group(1)) for name in os.listdir(save_dir) if (m := _ITER_RE.match(name))]
    return sorted(steps)


def read_latest(save_dir: str) -> int | None:
    """The step named by ``latest_checkpointed_iteration.txt``, or None if there is none."""
    path = os.path.join(save_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:  # bytes: a corrupt file is reported, not a UnicodeDecodeError
        text = f.read(64).decode("utf-8", errors="replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def _resume_candidates(load_dir: str, latest: int) -> list[int]:
    """The steps a resume tries, in order: ``latest``, then the older complete checkpoints."""
    return [latest] + [s for s in reversed(list_checkpoints(load_dir)) if s < latest]


def resume_dir(load_dir: str) -> str | None:
    """The iteration directory a resume from ``load_dir`` will read, found without loading
    anything (so ``gspo-train`` can refuse a broken resume before it writes the run directory).

    ``None`` when ``load_dir`` has no ``latest_checkpointed_iteration.txt`` (nothing to resume).
    Otherwise the first of :func:`load_checkpoint`'s candidates that holds a dist checkpoint.
    Raises :class:`CheckpointError` for a tracker that is not a number, or one that names an
    iteration that is missing when no older checkpoint is there to fall back to."""
    latest = read_latest(load_dir)
    if latest is None:
        return None
    for step in _resume_candidates(load_dir, latest):
        directory = iteration_dir(load_dir, step)
        if os.path.isfile(os.path.join(directory, _DIST_METADATA)):
            return directory
    raise CheckpointError(
        f"{os.path.join(load_dir, TRACKER_FILE)}: names iteration {latest}, but "
        f"{iteration_dir(load_dir, latest)} is missing or not a checkpoint and no older checkpoint "
        "is there to resume from (remove the file to start afresh)")


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_safe(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(_tuplify(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_state_to_safe(state) -> tuple:
    """numpy's RNG state with its key array as a tensor (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _describe(exc: BaseException) -> str:
    """One line for a load failure; torch's CheckpointException wraps the real error per rank."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def _optimizer_has_state(optimizer) -> bool:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(state) > 0 for opt in inner for state in opt.optimizer.state.values())


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class TrainingState:
    """The non-tensor state a resume needs besides weights and optimizer."""

    step: int
    """RL steps completed."""
    extra: dict
    """Trainer state: data sampler position, counters (JSON-like values only)."""


def save_checkpoint(policy, save_dir: str, state: TrainingState, keep_last: int = 2,
                    before_commit=None, writer: AsyncCheckpointWriter | None = None) -> str:
    """Write model, optimizer, scheduler, RNG and ``state`` for ``state.step`` (collective).

    ``before_commit(step)`` runs once the shards are written, before they are renamed into place
    (fault injection: a crash there must leave the previous checkpoint the latest). With a
    ``writer`` the shards are written in the background and the commit happens in
    ``writer.wait()`` (which this call makes first for a checkpoint still in flight)."""
    from megatron.core import dist_checkpointing

    if writer is not None:
        writer.wait()
    final = iteration_dir(save_dir, state.step)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed write
        os.makedirs(tmp)
    _barrier()
    gpt = policy.unwrapped()
    model_sd = gpt.sharded_state_dict()
    extra = dict(state.extra)
    rank_state = extra.pop(RANK_STATE_KEY, None)  # this rank's own: beside its RNG state
    # A fresh optimizer (no step taken yet) has no Adam state to save; loading then skips it.
    with_optimizer = _optimizer_has_state(policy.optimizer)
    sharded = {
        TRAINING_MODEL_KEY: model_sd,
        "scheduler": policy.scheduler.state_dict(),
        "step": state.step,
        "extra": extra,
        "has_optimizer_state": with_optimizer,
    }
    if with_optimizer:
        sharded["optimizer"] = policy.optimizer.sharded_state_dict(model_sd)

    def save_rng() -> None:  # after dist_checkpointing.save: it warns about a non-empty directory
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
        if rank_state is not None:
            os.makedirs(os.path.join(tmp, RANK_STATE_KEY), exist_ok=True)
            torch.save({"format": plain_state.FORMAT, "state": plain_state.encode(rank_state)},
                       os.path.join(tmp, RANK_STATE_KEY, f"rank_{_rank():05d}.pt"))

    def commit() -> None:
        if before_commit is not None:
            before_commit(state.step)
        _barrier()
        if _rank() == 0:
            _commit_on_rank0(save_dir, tmp, final, state.step, keep_last)
        _barrier()
        logger.info("saved checkpoint %s", final)

    if writer is None:
        dist_checkpointing.save(sharded, tmp)
        save_rng()
        commit()
    else:
        request = dist_checkpointing.save(sharded, tmp, async_sharded_save=True)
        save_rng()
        request.add_finalize_fn(commit)
        writer.schedule(request)
    return final


def _commit_on_rank0(save_dir: str, tmp: str, final: str, step: int, keep_last: int) -> None:
    """Rename the written ``tmp`` into place, then point the tracker file at it (atomically,
    fsynced), then prune checkpoints beyond ``keep_last``."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = os.path.join(save_dir, TRACKER_FILE)
    with open(pointer + ".tmp", "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    for old in list_checkpoints(save_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(iteration_dir(save_dir, old), ignore_errors=True)


def load_checkpoint(policy, load_dir: str, step: int | None = None,
                    allow_pickle: bool = False) -> TrainingState:
    """Restore the checkpoint at ``step`` (default: the latest; falls back to older complete ones
    if it cannot be read). Raises :class:`CheckpointError` when none can be loaded, and
    :class:`UnsafeCheckpointError` at once for a per-rank state that needs ``allow_pickle``."""
    latest = read_latest(load_dir) if step is None else step
    if latest is None:
        raise CheckpointError(f"{load_dir}: no {TRACKER_FILE}; nothing to resume from")
    candidates = _resume_candidates(load_dir, latest)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    errors = []
    for candidate in candidates:
        try:
            return _load_one(policy, iteration_dir(load_dir, candidate), allow_pickle)
        except UnsafeCheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - report, try the previous
            errors.append(f"{iteration_dir(load_dir, candidate)}: {_describe(exc)}")
            logger.warning("checkpoint %s failed to load (%s); trying an older one",
                           iteration_dir(load_dir, candidate), exc)
    raise CheckpointError("no loadable checkpoint:\n  " + "\n  ".join(errors))


def _load_one(policy, directory: str, allow_pickle: bool = False) -> TrainingState:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} does not exist")
    gpt = policy.unwrapped()
    common = dist_checkpointing.load_common_state_dict(directory)
    model_sd = gpt.sharded_state_dict()
    sharded = {TRAINING_MODEL_KEY: model_sd}
    if common.get("has_optimizer_state", True):
        sharded["optimizer"] = policy.optimizer.sharded_state_dict(model_sd, is_loading=True)
    loaded = dist_checkpointing.load(sharded, directory)
    loaded = {**common, **loaded}
    gpt.load_state_dict(loaded[TRAINING_MODEL_KEY], strict=True)
    if "optimizer" in loaded:
        policy.optimizer.load_state_dict(loaded["optimizer"])
    policy.scheduler.load_state_dict(loaded["scheduler"])
    rng_path = os.path.join(directory, "rng", f"rank_{_rank():05d}.pt")
    if os.path.isfile(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=True))
    else:
        logger.warning("%s: no RNG state for rank %d (different world size?)", directory, _rank())
    extra = dict(loaded["extra"] or {})
    rank_state = read_rank_state(directory, _rank(), allow_pickle)
    if rank_state is not None:
        extra[RANK_STATE_KEY] = rank_state
    return TrainingState(step=int(loaded["step"]), extra=extra)


def read_rank_state(directory: str, rank: int, allow_pickle: bool = False) -> Any:
    """Rank ``rank``'s own part of the checkpoint ``directory`` (the rollouts in flight, written
    by :func:`save_checkpoint` as :mod:`.plain_state`), or None when it has none. Read with
    ``weights_only=True``; a file that needs a full unpickle (written before the plain format, or
    not by gspo-train) raises :class:`UnsafeCheckpointError` unless ``allow_pickle``."""
    path = os.path.join(directory, RANK_STATE_KEY, f"rank_{rank:05d}.pt")
    if not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{path}: holds pickled Python objects, which can run code when loaded (a "
                "checkpoint written before gspo-train saved plain data, or not by gspo-train); "
                "if you trust it, set checkpoint.allow_pickle: true") from None
        logger.warning("%s: loading pickled objects (checkpoint.allow_pickle)", path)
        return torch.load(path, weights_only=False)
    if not (isinstance(saved, dict) and saved.get("format") == plain_state.FORMAT):
        return saved  # written before the format by a run with nothing but plain data in flight
    try:
        return plain_state.decode(saved["state"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


# ------------------------------------------------------------------ model weights only

def save_model_weights(gpt_model, directory: str) -> None:
    """Save this rank's shard of ``gpt_model`` (a ``GPTModel``) into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(gpt_model.sharded_state_dict(), directory)


def resolve_weights_dir(directory: str) -> str:
    """The dist-checkpoint directory holding model weights for ``directory``.

    Accepts a model-weights directory (``save_model_weights``, ``gspo-convert-hf``, a run's
    ``sft_weights``), one training checkpoint (``.../checkpoints/iter_XXXXXXX``) or a training
    checkpoints directory (the iteration named by ``latest_checkpointed_iteration.txt``).
    Raises :class:`CheckpointError` naming the directory when it is none of these."""
    if not os.path.exists(directory):
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    if not os.path.isdir(directory):
        raise CheckpointError(f"not a directory: {directory}")
    if os.path.isfile(os.path.join(directory, _DIST_METADATA)):
        return directory
    if os.path.isfile(os.path.join(directory, TRACKER_FILE)):
        step = read_latest(directory)
        it = iteration_dir(directory, step)
        if not os.path.isfile(os.path.join(it, _DIST_METADATA)):
            raise CheckpointError(f"{directory}: {TRACKER_FILE} names iteration {step} but {it} "
                                  "is missing or not a checkpoint")
        return it
    raise CheckpointError(f"not a checkpoint directory: {directory} (no {_DIST_METADATA} and no "
                          f"{TRACKER_FILE})")


def is_training_checkpoint(directory: str) -> bool:
    """Whether ``directory`` (a dist checkpoint) was written by :func:`save_checkpoint`."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(directory)
    return isinstance(common, dict) and "has_optimizer_state" in common and "step" in common


def checkpoint_tensor_dtype(directory: str) -> torch.dtype | None:
    """The most common dtype among the stored model tensors of a weights/training checkpoint
    (optimizer state excluded), or None when the metadata says nothing."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(resolve_weights_dir(directory))
    counts: dict[torch.dtype, int] = {}
    for key, item in meta.items():
        if key.startswith("optimizer.") or not hasattr(item, "dtype") or item.dtype is None:
            continue
        counts[item.dtype] = counts.get(item.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


def _stored_tensors(directory: str) -> dict:
    """``{key: ShardedTensor metadata}`` of a dist checkpoint, read from its metadata only."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_tensors_metadata(directory)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"{directory}: cannot read the checkpoint's metadata: "
                              f"{_describe(exc)}") from exc


def _expected_shapes(model) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """``{key: (global shape, the model fields behind it)}`` for the tensors whose stored shape
    is the same under every layout and layer spec Megatron saves (``None``: any size). Expert and
    dense-MLP widths are left out: grouped and sequential experts store them differently."""
    h, d, layers = model.hidden_size, model.head_dim(), model.num_layers
    heads, groups = model.num_attention_heads, model.num_query_groups
    vocab = (model.padded_vocab_size(), h)
    why_vocab = f"model.vocab_size padded to {vocab[0]}, model.hidden_size"
    out = {
        "embedding.word_embeddings.weight": (vocab, why_vocab),
        "decoder.final_layernorm.weight": ((h,), "model.hidden_size"),
        "decoder.layers.self_attention.linear_qkv.weight": (
            (layers, (heads + 2 * groups) * d, h),
            "model.num_layers, (num_attention_heads + 2 x num_query_groups) x kv_channels, "
            "hidden_size"),
        "decoder.layers.self_attention.linear_proj.weight": (
            (layers, h, heads * d),
            "model.num_layers, hidden_size, num_attention_heads x kv_channels"),
        "decoder.layers.self_attention.q_layernorm.weight": ((layers, d), "model.kv_channels"),
        "decoder.layers.mlp.router.weight": ((None, model.num_moe_experts, h),
                                             "model.num_moe_experts, hidden_size"),
    }
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (vocab, why_vocab)
    return out


SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                 "start_wd", "end_wd")
"""The keys of Megatron's scheduler state that set the LR and weight decay of every later step
(``wd_incr_steps`` is left out: our weight decay is constant, so it changes nothing)."""


def schedule_mismatch(directory: str, schedule: dict) -> tuple[str, object, object] | None:
    """The first of :data:`SCHEDULE_KEYS` whose value in the checkpoint ``directory`` (an
    ``iter_XXXXXXX``) differs from ``schedule`` (:func:`.policy.lr_schedule`'s), as ``(key, this
    config's, the checkpoint's)``; None when they agree or the checkpoint holds no schedule.
    Reads the checkpoint's small common state only."""
    from megatron.core import dist_checkpointing

    try:
        saved = dist_checkpointing.load_common_state_dict(directory).get("scheduler") or {}
    except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint is reported when loaded
        logger.warning("%s: scheduler state not readable (%s)", directory, exc)
        return None
    for key in SCHEDULE_KEYS:
        if key in saved and saved[key] != schedule[key]:
            return key, schedule[key], saved[key]
    return None


def weights_mismatch(directory: str, model) -> str | None:
    """Why the model weights in ``directory`` (anything :func:`resolve_weights_dir` accepts) do not
    fit a model built from ``model`` (a :class:`~gspo_megatron.config.ModelConfig`), or ``None``.

    Read-only and without building the model: the checkpoint's tensor metadata is compared with
    the shapes the config implies (:func:`_expected_shapes`), so ``gspo-train`` refuses a wrong
    ``checkpoint.init_weights`` before it writes anything. :func:`load_model_weights` still checks
    every tensor when it loads. Raises :class:`CheckpointError` when ``directory`` is not a
    checkpoint or its metadata cannot be read."""
    directory = resolve_weights_dir(directory)
    stored = _stored_tensors(directory)
    for key, (want, fields) in _expected_shapes(model).items():
        found = stored.get(key)
        if found is None:
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                return f"{directory}: model tensor {key} is missing from the checkpoint"
            continue
        have = list(found.global_shape)
        # A free dimension (None) takes the stored size: only the sizes the config fixes differ.
        want = [x if w is None else w for w, x in zip(want, have)] if len(want) == len(have) \
            else ["*" if w is None else w for w in want]
        if want != have:
            return (f"{directory}: model tensor {key} has shape {have} in the checkpoint, "
                    f"the config's model gives {want} ({fields})")
    return None


def _check_model_keys(sharded_state_dict, directory: str) -> None:
    """Every model ShardedTensor stored in ``directory`` with its global shape, else raise."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stored = _stored_tensors(directory)
    expected = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensorFactory):
            built = item.build()
            expected.extend(v for v in nested_values(built if isinstance(built, dict) else [built])
                            if isinstance(v, ShardedTensor))
        elif isinstance(item, ShardedTensor):
            expected.append(item)
    for st in expected:
        found = stored.get(st.key)
        if found is None:
            raise CheckpointError(f"{directory}: model tensor {st.key} is missing from the checkpoint")
        if tuple(found.global_shape) != tuple(st.global_shape):
            raise CheckpointError(
                f"{directory}: model tensor {st.key} has shape {list(found.global_shape)} in the "
                f"checkpoint, the model expects {list(st.global_shape)}")


def load_model_weights(gpt_model, directory: str) -> str:
    """Load the model weights of ``directory`` into ``gpt_model`` whatever layout saved them
    (collective); strict on the model's own tensors, everything else in a training checkpoint
    (optimizer, scheduler, step, extra state) is ignored.

    ``directory``: anything :func:`resolve_weights_dir` accepts. Returns the directory actually
    read. Raises :class:`CheckpointError` naming the directory (and the tensor) when it is not a
    checkpoint, a model tensor is missing or its shape differs."""
    from megatron.core import dist_checkpointing

    directory = resolve_weights_dir(directory)
    model_sd = gpt_model.sharded_state_dict()
    _check_model_keys(model_sd, directory)
    training = is_training_checkpoint(directory)
    try:
        if training:
            loaded = dist_checkpointing.load({TRAINING_MODEL_KEY: model_sd}, directory)
            state = loaded[TRAINING_MODEL_KEY]
        else:
            state = dist_checkpointing.load(model_sd, directory)
    except CheckpointError:
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"{directory}: cannot load model weights: {_describe(exc)}") from exc
    own = set(gpt_model.state_dict())
    state = {k: v for k, v in state.items() if k in own or not training}
    try:
        gpt_model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(f"{directory}: {' '.join(line.strip() for line in first[:3])}") from exc
    return directory
