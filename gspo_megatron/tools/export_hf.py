"""Convert a Megatron ``dist_checkpointing`` directory of the Qwen3-MoE policy back to Hugging Face.

    gspo-export-hf --mcore-dir run/checkpoints --out /models/qwen3-30b-rl --max-shard-size 5GB

``--mcore-dir`` may be any checkpoint gspo-train or gspo-convert-hf writes: a training checkpoint
(``run/checkpoints/iter_XXXXXXX``; only the model weights are read), the checkpoints directory
(its latest iteration), a run's ``sft_weights`` or a converted directory. For a run, the converted
directory it started from is found through ``checkpoint.init_weights`` in ``run/config.yaml``; it
supplies the model config, the source dtype (the default output dtype) and the tokenizer files.

Writes ``config.json`` (``Qwen3MoeForCausalLM``; the source ``hf_config.json`` kept by
``gspo-convert-hf`` supplies token ids and other fields the ModelConfig does not carry) and
safetensors with the Hub's per-expert names: ``model.safetensors`` when everything fits in one
shard, else ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``. The result
loads with ``transformers.AutoModelForCausalLM.from_pretrained``.

The checkpoint may have been saved under any layout; it is loaded unsharded (TP=1) in one process.
Memory: the model once plus one output shard (its tensors are copied out, then serialised).
Everything is written to a temporary directory beside ``--out`` and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys

import torch

from gspo_megatron.hf.config import hf_config_from_model_config, model_config_from_hf
from gspo_megatron.hf.weights import conversion_plan, extract, hf_expected_shapes
from gspo_megatron.config.model import MODEL_CONFIG_FILE, ModelConfig, find_converted_dir
from gspo_megatron.progress import Progress
from gspo_megatron.tools.convert_hf import (DTYPE_NAMES, HF_CONFIG_FILE, HF_FILES_DIR, HF_SOURCE_FILE,
                                            SIDE_FILES, ConversionError,
                                            check_destination, commit_output, fresh_temp_dir,
                                            copy_side_files, hf_config_dtype, hide_gpus,
                                            release_freed_memory_eagerly, run_cli)

logger = logging.getLogger("gspo-export-hf")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``5GB``, ``500MB``, ``20KB`` (powers of 1000, as HF)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m:
        raise ValueError(f"cannot parse size {size!r}")
    unit = m.group(2).rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def read_mcore_configs(mcore_dir: str) -> tuple[ModelConfig, dict | None, str | None]:
    """ModelConfig, the source HF config (if kept) and the checkpoint dtype name from a converted dir."""
    path = os.path.join(mcore_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{MODEL_CONFIG_FILE} not found in {mcore_dir}; pass --hf-config")
    with open(path) as f:
        meta = json.load(f)
    dtype = meta.pop("checkpoint_dtype", None)
    cfg = ModelConfig(**{k: v for k, v in meta.items()
                         if k in {f.name for f in dataclasses.fields(ModelConfig)}})
    hf = None
    hf_path = os.path.join(mcore_dir, HF_CONFIG_FILE)
    if os.path.isfile(hf_path):
        with open(hf_path) as f:
            hf = json.load(f)
    return cfg, hf, dtype


def shard_layout(cfg: ModelConfig, dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """HF tensor names grouped into shards of at most ``max_shard_bytes`` (a lone larger tensor
    gets its own shard), in plan order."""
    shapes = hf_expected_shapes(cfg)
    elsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for target in conversion_plan(cfg):
        for piece in target.pieces:
            nbytes = elsize * int(torch.Size(shapes[piece.hf_name]).numel())
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(piece.hf_name)
            size += nbytes
    return shards


def write_hf_from_model(gpt_model, cfg: ModelConfig, directory: str, dtype: torch.dtype,
                        max_shard_bytes: int, show_progress: bool = False) -> list[str]:
    """Write the model's weights as HF safetensors shards into ``directory``; returns file names.
    ``show_progress``: the count of tensors written and an ETA on stderr."""
    from safetensors.torch import save_file

    state = gpt_model.state_dict()
    pieces = {p.hf_name: (t.mcore_name, p) for t in conversion_plan(cfg) for p in t.pieces}
    layout = shard_layout(cfg, dtype, max_shard_bytes)
    n = len(layout)
    files, weight_map, total = [], {}, 0
    progress = Progress("write HF tensors", sum(map(len, layout)), stream=sys.stderr,
                        enabled=show_progress)
    for i, names in enumerate(layout):
        file = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        shard = {}
        for name in names:
            mcore_name, piece = pieces[name]
            shard[name] = extract(state[mcore_name], piece, cfg).to(dtype)
            total += shard[name].numel() * shard[name].element_size()
            weight_map[name] = file
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
        del shard
        files.append(file)
        progress.update(len(weight_map))  # (per shard: what is on disk)
    progress.close()
    if n > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
    return files


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc})") from exc


def convert_mcore_to_hf(mcore_dir: str, out: str, *, max_shard_size: int | str = "5GB",
                        dtype: str | None = None, hf_config: str | dict | None = None,
                        hf_dir: str | None = None, copy_side_files_from: str | None = None,
                        overwrite: bool = False, show_progress: bool = False) -> ModelConfig:
    """Convert the checkpoint ``mcore_dir`` into an HF directory ``out`` (one process).

    ``mcore_dir``: any directory :func:`~gspo_megatron.backends.megatron.checkpoint.resolve_weights_dir`
    accepts (training checkpoint, checkpoints dir, ``sft_weights``, converted dir).
    ``hf_dir``: the source HF directory (its config.json is the base config and dtype, its tokenizer
    / generation-config files are carried); default: what the converted directory recorded.
    ``hf_config``: only a config.json (or dict) describing the model.
    ``copy_side_files_from``: an HF directory whose ``SIDE_FILES`` are copied (overrides ``hf_dir``'s).
    ``dtype``: output dtype; default the source HF dtype, else the checkpoint's.
    ``show_progress``: the tensors written and an ETA on stderr (the command line's).
    """
    import torch.distributed as dist

    from gspo_megatron.backends.megatron.checkpoint import (checkpoint_tensor_dtype,
                                                            load_model_weights, resolve_weights_dir)
    from gspo_megatron.hf.config import load_hf_config
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig

    # Validate everything before a process group, a weight or a file exists.
    check_destination(out, overwrite)
    weights_dir = resolve_weights_dir(mcore_dir)  # CheckpointError: missing / not a checkpoint
    for opt, path in (("--hf-dir", hf_dir), ("--copy-side-files-from", copy_side_files_from)):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"{opt} directory not found: {path}")
    converted = find_converted_dir(mcore_dir)
    source = (_read_json(os.path.join(converted, HF_SOURCE_FILE)) or {}) if converted else {}
    saved_dtype = None
    if hf_config is not None or hf_dir is not None:
        base = hf_config if isinstance(hf_config, dict) else load_hf_config(hf_config or hf_dir)
        cfg = model_config_from_hf(base)
    elif converted is not None:
        cfg, base, saved_dtype = read_mcore_configs(converted)
    else:
        raise ConversionError(f"{mcore_dir}: cannot tell which model this is (no {MODEL_CONFIG_FILE} "
                              "here or in the converted directory the run started from); pass "
                              "--hf-dir or --hf-config")
    dtype_name = (dtype or (hf_config_dtype(base) if base else None) or source.get("dtype")
                  or saved_dtype or "float32")
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype_name!r}")
    torch_dtype = DTYPE_NAMES[dtype_name]
    max_bytes = parse_size(max_shard_size)
    hf_out = hf_config_from_model_config(cfg, base=base, dtype=dtype_name)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError("convert_mcore_to_hf runs in a single process (WORLD_SIZE=1)")
    side_dirs = [d for d in (copy_side_files_from, hf_dir) if d]
    if not side_dirs and converted is not None:
        side_dirs = [os.path.join(converted, HF_FILES_DIR)]
        if source.get("hf_dir"):
            side_dirs.append(source["hf_dir"])
    side_dir = next((d for d in side_dirs
                     if os.path.isdir(d) and any(os.path.isfile(os.path.join(d, n)) for n in SIDE_FILES)),
                    None)
    # Build the model in the dtype the weights are stored in (a training checkpoint holds the
    # training dtype, a converted one the source dtype): loading is exact, memory is the model once.
    load_dtype = checkpoint_tensor_dtype(weights_dir) or (DTYPE_NAMES.get(saved_dtype) if saved_dtype
                                                          else torch_dtype)

    owns_dist = not dist.is_initialized()
    parallel = ParallelConfig(sequence_parallel=False)
    initialize_distributed(parallel, cfg, seed=0)
    tmp = fresh_temp_dir(out)
    try:
        gpt = build_gpt_model(
            cfg, parallel, PrecisionConfig(transformer_impl="local"), pre_process=True,
            post_process=True, transformer_config_overrides=dict(
                params_dtype=load_dtype, perform_initialization=False,
                use_cpu_initialization=True))
        gpt.to("cpu")
        load_model_weights(gpt, weights_dir)
        os.makedirs(tmp)
        files = write_hf_from_model(gpt, cfg, tmp, torch_dtype, max_bytes,
                                    show_progress=show_progress)
        del gpt
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_out, f, indent=2, sort_keys=True)
        carried = copy_side_files(side_dir, tmp) if side_dir else []
        commit_output(tmp, out)
        logger.info("wrote %s from %s (%d safetensors file(s), %s; carried: %s)", out, weights_dir,
                    len(files), dtype_name, ", ".join(carried) or "nothing")
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if owns_dist:
            destroy_distributed()
    return cfg


def export_in_subprocess(mcore_dir: str, out: str) -> None:
    """Run ``gspo-export-hf --mcore-dir mcore_dir --out out`` as a fresh single process (what
    ``checkpoint.export_hf`` does at the end of a run, on global rank 0): it needs a process group
    of its own (TP=1, one process) and its memory is freed when it exits. Raises
    ``RuntimeError`` with the exporter's last error line when it fails."""
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.tools.export_hf",
                           "--mcore-dir", mcore_dir, "--out", out],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise RuntimeError(f"checkpoint.export_hf: export to {out} failed: "
                           f"{lines[-1] if lines else f'exit code {proc.returncode}'}")


def main(argv: list[str] | None = None) -> int:
    hide_gpus()
    ap = argparse.ArgumentParser(prog="gspo-export-hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mcore-dir", required=True,
                    help="a training checkpoint (run/checkpoints/iter_N), a checkpoints dir (its "
                         "latest), run/sft_weights or a gspo-convert-hf directory")
    ap.add_argument("--out", required=True, help="destination HF directory")
    ap.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                    help="safetensors dtype (default: the source HF model's, else the checkpoint's)")
    ap.add_argument("--hf-config", default=None,
                    help="config.json (or HF dir) describing the model, for checkpoints not made "
                         "by gspo-convert-hf")
    ap.add_argument("--hf-dir", default=None,
                    help="the source HF directory: base config.json, dtype, tokenizer files "
                         "(default: what gspo-convert-hf recorded)")
    ap.add_argument("--copy-side-files-from", default=None, metavar="HF_DIR",
                    help="copy tokenizer / generation_config files from this HF directory")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    release_freed_memory_eagerly()
    return run_cli("gspo-export-hf", lambda: convert_mcore_to_hf(
        args.mcore_dir, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
        hf_config=args.hf_config, hf_dir=args.hf_dir, copy_side_files_from=args.copy_side_files_from,
        overwrite=args.overwrite, show_progress=True))


if __name__ == "__main__":
    sys.exit(main())
