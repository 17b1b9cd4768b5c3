"""Convert a Hugging Face Qwen3-MoE checkpoint into a Megatron ``dist_checkpointing`` directory.

    gspo-convert-hf --hf-dir /models/Qwen3-30B-A3B --out /ckpt/qwen3-30b-mcore
    torchrun --nproc_per_node 8 -m gspo_megatron.tools.convert_hf --hf-dir ... --out ... --ep 8

The result loads with :func:`gspo_megatron.backends.megatron.checkpoint.load_model_weights` under any
TP/EP/PP layout (Megatron reshards at load time). Next to the checkpoint the tool writes
``hf_config.json`` (the source config.json, used again on export) and ``model_config.json``
(the :class:`ModelConfig` it was built with).

Memory: the destination model exists once (TP=1, in the checkpoint's dtype, allocated without
initialisation); HF tensors are read one at a time from each shard (``safe_open``) and copied
straight into their slice of the destination, so the peak is about the model plus one shard's
pages. Under torchrun with ``--ep`` / ``--pp`` each rank allocates and reads only its part.

Atomicity: everything is written to a hidden temporary directory beside ``--out`` which is renamed
into place at the end; on any error it is removed and ``--out`` is left untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import uuid
from dataclasses import dataclass

import torch

from gspo_megatron.hf.config import load_hf_config, model_config_from_hf
from gspo_megatron.hf.weights import hf_expected_shapes, place, uses_fused_experts
from gspo_megatron.config.model import MODEL_CONFIG_FILE, ModelConfig
from gspo_megatron.progress import Progress

logger = logging.getLogger("gspo-convert-hf")

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F64": torch.float64}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_CONFIG_FILE = "hf_config.json"
# {"dtype": the source config.json's torch_dtype/dtype, "hf_dir": absolute source path}
HF_SOURCE_FILE = "hf_source.json"
# Non-weight files of the HF directory copied into <converted>/hf_files (tokenizer, generation
# defaults) so that export can carry them even when the source directory has moved.
HF_FILES_DIR = "hf_files"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
              "special_tokens_map.json", "added_tokens.json", "generation_config.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.model")


class ConversionError(ValueError):
    """Bad input for gspo-convert-hf / gspo-export-hf; the message names the file or directory."""


def hf_config_dtype(config: dict) -> str | None:
    """The dtype name a HF config.json declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def hf_model_name(config: dict, hf_dir: str) -> str:
    """The converted model's name, written as ``model.preset`` (a free label) into
    model_config.json so that runs from it say which model they train: the HF config's
    ``_name_or_path`` when it is a Hub id (``Qwen/Qwen3-30B-A3B``), else the source directory's
    name (``_name_or_path`` is often empty, or the absolute path of a directory that has since
    moved)."""
    name = config.get("_name_or_path")
    if isinstance(name, str) and name.strip():
        name = name.strip()
        hub_id = name.count("/") <= 1 and not name.startswith(("/", ".", "~")) and "\\" not in name
        if hub_id and not os.path.isdir(name):
            return name
    return os.path.basename(os.path.normpath(os.path.abspath(hf_dir)))


def check_safetensors_file(path: str) -> None:
    """Raise :class:`ConversionError` naming ``path`` if it is not a complete safetensors file
    (header unreadable, or data shorter than the header says: a truncated download/copy)."""
    import struct

    name = os.path.basename(path)
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise ConversionError(f"safetensors shard {name} in {os.path.dirname(path)} is not readable "
                              f"({exc})") from exc
    if 8 + n + end > size:
        raise ConversionError(f"safetensors shard {name} in {os.path.dirname(path)} is truncated: "
                              f"{size} bytes, its header needs {8 + n + end}")


@dataclass
class HFCheckpoint:
    """What the safetensors headers say, read without loading any tensor."""

    directory: str
    config: dict
    files: list[str]
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    """HF name -> (file, shape, safetensors dtype)."""

    @property
    def fused_experts(self) -> bool:
        return uses_fused_experts(self.tensors)

    def dtype(self) -> torch.dtype:
        """The floating dtype of the weights (the most common one if mixed)."""
        counts: dict[str, int] = {}
        for _, _, dt in self.tensors.values():
            counts[dt] = counts.get(dt, 0) + 1
        name = max(counts, key=counts.get)
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"unsupported safetensors dtype {name}")
        return SAFETENSORS_DTYPES[name]


def read_hf_checkpoint(directory: str) -> HFCheckpoint:
    """Config and tensor index of an HF directory; every shard the index names must exist."""
    from safetensors import safe_open

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"HF model directory not found: {directory}")
    config = load_hf_config(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise ConversionError(f"{index} is not a valid safetensors index ({exc!r})") from exc
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {directory}")
    missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(
            f"shard {missing[0]} named by model.safetensors.index.json is missing from {directory}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for file in files:
        check_safetensors_file(os.path.join(directory, file))
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(os.path.join(directory, file), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                if name in tensors:
                    raise ValueError(f"tensor {name} is stored twice ({tensors[name][0]} and {file})")
                tensors[name] = (file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise ValueError(f"tensor {name} is listed in the index for {file} but not stored there")
            if tensors[name][0] != file:
                raise ValueError(f"tensor {name} is in {tensors[name][0]}, index says {file}")
    return HFCheckpoint(directory, config, files, tensors)


def validate_hf_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig) -> None:
    """Every expected tensor present with its shape, nothing unexpected (names tensor and shapes)."""
    expected = hf_expected_shapes(cfg, fused_experts=ckpt.fused_experts)
    for name, shape in expected.items():
        if name not in ckpt.tensors:
            raise ValueError(f"tensor {name} is missing from the HF checkpoint {ckpt.directory}")
        found = ckpt.tensors[name][1]
        if tuple(found) != tuple(shape):
            raise ValueError(
                f"shape mismatch for tensor {name} (in {ckpt.tensors[name][0]}): checkpoint has "
                f"{list(found)}, config.json implies {list(shape)}")
    extra = sorted(set(ckpt.tensors) - set(expected))
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # tied: HF ignores a stored head, and so do we
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]} in the HF checkpoint ({len(extra)} in all); "
                         "unsupported architecture feature?")


def fresh_temp_dir(out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    return os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{uuid.uuid4().hex[:8]}")


def check_destination(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"destination exists and is not a directory: {out}")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"destination is not empty: {out} (pass --overwrite to replace it)")


def commit_output(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = None
    if os.path.lexists(out):
        old = fresh_temp_dir(out) + ".old"
        os.rename(out, old)
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def fill_model_from_hf(gpt_model, cfg: ModelConfig, ckpt: HFCheckpoint,
                       show_progress: bool = False) -> int:
    """Copy this rank's part of the HF checkpoint into ``gpt_model`` in place, one tensor at a time
    (``show_progress``: their count and an ETA on stderr).

    Returns the number of HF tensors read. Raises if a model tensor is left without a source.
    """
    from safetensors import safe_open

    from gspo_megatron.hf.weights import conversion_plan_for_model, mcore_tensor_names

    state = gpt_model.state_dict()
    plan = conversion_plan_for_model(gpt_model, cfg, fused_experts=ckpt.fused_experts)
    uncovered = mcore_tensor_names(state) - {t.mcore_name for t in plan}
    if uncovered:
        raise RuntimeError(f"no HF source for Megatron tensors {sorted(uncovered)[:5]}")
    by_file: dict[str, list] = {}
    for target in plan:
        for piece in target.pieces:
            by_file.setdefault(ckpt.tensors[piece.hf_name][0], []).append((target.mcore_name, piece))
    read = 0
    total = sum(map(len, by_file.values()))
    with Progress("read HF tensors", total, stream=sys.stderr, enabled=show_progress) as progress:
        for file in ckpt.files:  # one shard open at a time
            todo = by_file.get(file)
            if not todo:
                continue
            with safe_open(os.path.join(ckpt.directory, file), framework="pt") as st:
                for mcore_name, piece in todo:
                    if piece.expert is not None:  # one expert of a fused 3-D tensor
                        src = st.get_slice(piece.hf_name)[piece.expert]
                    else:
                        src = st.get_tensor(piece.hf_name)
                    place(state[mcore_name], piece, src, cfg)
                    read += 1
                    progress.update(read)
                    del src
    return read


def save_releasing_model(gpt_model, directory: str) -> None:
    """``dist_checkpointing.save`` of ``gpt_model`` that does not hold the model twice; the model's
    weights are unusable afterwards.

    Megatron saves a SwiGLU ``linear_fc1`` as two views (gate, up) made by a sharded-tensor
    factory, and its writer clones every view before writing anything: about 2/3 of all expert
    weights at once (measured: peak 1.6x the model instead of 1x). Here the factories are applied
    first and, parameter by parameter, the views are replaced by their clones and the parameter's
    own storage is released, so the extra memory is one ``linear_fc1`` at a time.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    os.makedirs(directory, exist_ok=True)
    sharded = gpt_model.sharded_state_dict()
    apply_factories(sharded)
    views: dict[int, list] = {}
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and torch.is_tensor(item.data):
            t = item.data
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                views.setdefault(t.untyped_storage().data_ptr(), []).append(item)
    with torch.no_grad():
        for param in gpt_model.parameters():
            group = views.pop(param.untyped_storage().data_ptr(), None)
            if not group:
                continue
            for item in group:
                item.data = item.data.clone()
            param.data = torch.empty(0, dtype=param.dtype)  # frees the original storage
    for group in views.values():  # views of non-parameters (none expected): clone, keep
        for item in group:
            item.data = item.data.clone()
    dist_checkpointing.save(sharded, directory)


def convert_hf_to_mcore(hf_dir: str, out: str, *, expert_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, dtype: str | torch.dtype | None = None,
                        overwrite: bool = False, show_progress: bool = False,
                        **model_overrides) -> ModelConfig:
    """Convert ``hf_dir`` into a dist checkpoint at ``out``; returns the :class:`ModelConfig`.

    Runs in one process by default (it starts a world-size-1 gloo group when torch.distributed is not
    initialised); under torchrun every rank must call it, and ``expert/pipeline_model_parallel_size``
    split the work (TP is always 1 here: Megatron reshards to any TP when loading).
    ``model_overrides`` set ModelConfig fields the HF config leaves open (e.g. ``seq_length``).
    ``show_progress``: rank 0 shows the tensors read and an ETA on stderr (the command line's).
    """
    import torch.distributed as dist

    from gspo_megatron.backends.megatron.checkpoint_writer import start_write_results_server
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig

    # Validate everything before a process group, a weight or a file exists.
    check_destination(out, overwrite)
    ckpt = read_hf_checkpoint(hf_dir)
    model_overrides.setdefault("preset", hf_model_name(ckpt.config, hf_dir))
    cfg = model_config_from_hf(ckpt.config, **model_overrides)
    validate_hf_checkpoint(ckpt, cfg)
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        dtype = DTYPE_NAMES[dtype]
    dtype = dtype or ckpt.dtype()

    parallel = ParallelConfig(expert_model_parallel_size=expert_model_parallel_size,
                              pipeline_model_parallel_size=pipeline_model_parallel_size,
                              sequence_parallel=False)
    owns_dist = not dist.is_initialized()
    start_write_results_server()  # before the model is built (its docstring says why)
    groups = initialize_distributed(parallel, cfg, seed=0)
    tmp = None
    try:
        rank0 = groups.rank == 0
        names = [fresh_temp_dir(out) if rank0 else None]
        if groups.world_size > 1:
            dist.broadcast_object_list(names, src=0)
        tmp = names[0]
        gpt = build_gpt_model(
            cfg, parallel, PrecisionConfig(transformer_impl="local"),
            pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
            pp_rank=groups.pp_rank if groups.pp_size > 1 else None,
            transformer_config_overrides=dict(params_dtype=dtype, perform_initialization=False,
                                              use_cpu_initialization=True))
        gpt.to("cpu")
        n = fill_model_from_hf(gpt, cfg, ckpt, show_progress=show_progress and rank0)
        logger.info("rank %d: read %d HF tensors", groups.rank, n)
        if rank0:
            os.makedirs(tmp)
        if groups.world_size > 1:
            dist.barrier()
        save_releasing_model(gpt, tmp)
        del gpt
        if groups.world_size > 1:
            dist.barrier()
        if rank0:
            with open(os.path.join(tmp, HF_CONFIG_FILE), "w") as f:
                json.dump(ckpt.config, f, indent=2, sort_keys=True)
            meta = dataclasses.asdict(cfg)
            meta["checkpoint_dtype"] = str(dtype).removeprefix("torch.")
            with open(os.path.join(tmp, MODEL_CONFIG_FILE), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
            with open(os.path.join(tmp, HF_SOURCE_FILE), "w") as f:
                json.dump({"dtype": hf_config_dtype(ckpt.config) or str(ckpt.dtype()).removeprefix("torch."),
                           "hf_dir": os.path.abspath(hf_dir)}, f, indent=2, sort_keys=True)
            copy_side_files(hf_dir, os.path.join(tmp, HF_FILES_DIR))
            commit_output(tmp, out)
            tmp = None
        if groups.world_size > 1:
            dist.barrier()
    finally:
        if tmp is not None and groups.rank == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if owns_dist:
            destroy_distributed()
    return cfg


def copy_side_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the ``SIDE_FILES`` that exist in ``src_dir`` into ``dst_dir``; returns their names."""
    names = [n for n in SIDE_FILES if os.path.isfile(os.path.join(src_dir, n))]
    if names:
        os.makedirs(dst_dir, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


# Errors the command-line tools report as one line (exit 2) instead of a traceback.
USER_ERRORS = (ConversionError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
               PermissionError)


def run_cli(prog: str, fn) -> int:
    """Run ``fn()``; a user error (bad input, missing/non-checkpoint directory, shape mismatch)
    becomes one line ``<prog>: error: <message>`` on stderr and exit code 2."""
    from gspo_megatron.backends.megatron.checkpoint import CheckpointError

    try:
        fn()
    except (*USER_ERRORS, CheckpointError) as exc:
        msg = " ".join(str(exc).split()) if str(exc) else type(exc).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    return 0


def release_freed_memory_eagerly(threshold: int = 1 << 16) -> bool:
    """glibc: serve allocations >= ``threshold`` bytes with mmap so that freeing them returns the
    memory to the OS at once (the default dynamic threshold lets freed tensor buffers pile up in
    the heap: measured ~0.25x of the model extra during save). No-op elsewhere."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def hide_gpus() -> None:
    """A CPU tool: keep the model off any GPU. CUDA reads CUDA_VISIBLE_DEVICES when it initialises,
    which importing torch does not do, so the command-line entry points set it first thing."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main(argv: list[str] | None = None) -> int:
    hide_gpus()
    ap = argparse.ArgumentParser(prog="gspo-convert-hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="destination dist-checkpoint directory")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (under torchrun)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size (under torchrun)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                    help="checkpoint dtype (default: the safetensors dtype)")
    ap.add_argument("--seq-length", type=int, default=None,
                    help="ModelConfig.seq_length (default: max_position_embeddings)")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                    help="ModelConfig.make_vocab_size_divisible_by, Megatron-LM's flag (default "
                         "128: the vocabulary is padded to a multiple of it, padded rows zero; "
                         "1 keeps the HF vocabulary as it is)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    release_freed_memory_eagerly()
    overrides = {"seq_length": args.seq_length} if args.seq_length else {}
    if args.make_vocab_size_divisible_by is not None:
        overrides["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by

    def convert():
        cfg = convert_hf_to_mcore(args.hf_dir, args.out, expert_model_parallel_size=args.ep,
                                  pipeline_model_parallel_size=args.pp, dtype=args.dtype,
                                  overwrite=args.overwrite, show_progress=True, **overrides)
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("wrote %s (%d layers, %d experts)", args.out, cfg.num_layers,
                        cfg.num_moe_experts)

    return run_cli("gspo-convert-hf", convert)


if __name__ == "__main__":
    sys.exit(main())
