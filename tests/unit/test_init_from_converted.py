"""Training from a converted checkpoint: the model comes from its ``model_config.json``.

The converted directory is made by hand here, in the format ``gspo-convert-hf`` writes
(``dataclasses.asdict(ModelConfig)`` plus ``checkpoint_dtype``, ``json.dump(..., indent=2,
sort_keys=True)``); the converter itself is not run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from gspo_megatron.config.loader import ConfigError, load_config, save_config, validate_config
from gspo_megatron.config.model import (ARCHITECTURE_FIELDS, MODEL_CONFIG_FILE, MODEL_PRESETS,
                                        SHAPE_FIELDS, TRAINING_FIELDS, ModelConfig)

ROOT = Path(__file__).resolve().parents[2]

# A small Qwen3-MoE-like model, as model_config_from_hf would describe it (values differ from the
# ModelConfig defaults, so a field silently left at its default would show).
CONVERTED = ModelConfig(
    preset="hf", num_layers=3, hidden_size=96, num_attention_heads=6, num_query_groups=3,
    kv_channels=32, ffn_hidden_size=192, num_moe_experts=8, moe_router_topk=2,
    moe_ffn_hidden_size=48, moe_layer_freq=[1, 0, 1], moe_router_pre_softmax=False,
    moe_aux_loss_coeff=0.001, vocab_size=1000, seq_length=4096, rotary_base=1_000_000.0,
    norm_epsilon=1e-6, untie_embeddings_and_output_weights=True, init_method_std=0.02)


def converted_dir(tmp_path: Path, model: ModelConfig = CONVERTED, name: str = "converted",
                  **edits) -> Path:
    """A directory like gspo-convert-hf's output (no weights: load_config reads only the json)."""
    d = tmp_path / name
    d.mkdir()
    meta = dataclasses.asdict(model)
    meta["checkpoint_dtype"] = "bfloat16"
    meta.update(edits)
    with open(d / MODEL_CONFIG_FILE, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    (d / "hf_config.json").write_text("{}")
    return d


def recipe(tmp_path: Path, ckpt: Path, model: str = "", name: str = "recipe.yaml") -> str:
    """A recipe with only data / reward / tokenizer / init_weights (plus ``model`` lines)."""
    text = textwrap.dedent(f"""\
        data:
          source: arithmetic
        reward:
          fn: arithmetic_exact
        tokenizer:
          kind: sentencepiece
        checkpoint:
          init_weights: {ckpt}
        """)
    if model:
        text += "model:\n" + textwrap.indent(textwrap.dedent(model), "  ")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def errors_of(*args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return info.value.errors


def test_every_model_field_is_architecture_or_training() -> None:
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(ARCHITECTURE_FIELDS + TRAINING_FIELDS) == sorted(fields)
    assert not set(ARCHITECTURE_FIELDS) & set(TRAINING_FIELDS)
    assert set(SHAPE_FIELDS) <= set(ARCHITECTURE_FIELDS)


def test_model_comes_from_model_config_json(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(recipe(tmp_path, ckpt))
    assert cfg.model == CONVERTED
    assert validate_config(cfg, world_size=1) == 1  # train-ready: nothing else to state


def test_run_config_yaml_has_the_resolved_model(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(recipe(tmp_path, ckpt), ["--model.seq_length=2048"])
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    saved = yaml.safe_load(out.read_text())["model"]
    assert saved == {**dataclasses.asdict(CONVERTED), "seq_length": 2048}
    assert load_config(out) == cfg  # restating every field, all agreeing, loads back


def test_agreeing_restatement_and_equivalent_forms_are_accepted(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path, dataclasses.replace(CONVERTED, moe_layer_freq=1))
    cfg = load_config(recipe(tmp_path, ckpt, """\
        num_layers: 3
        rotary_base: 1e6
        moe_layer_freq: [1, 1, 1]
        kv_channels: 32
    """))
    assert cfg.model.moe_layer_freq == [1, 1, 1] and cfg.model.rotary_base == 1e6
    assert cfg.model.hidden_size == 96


def test_disagreements_are_refused_one_line_per_field(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    path = recipe(tmp_path, ckpt, """\
        rotary_base: 10000.0
        norm_epsilon: 1e-5
        moe_router_topk: 4
        moe_router_pre_softmax: true
        hidden_size: 96
    """)
    errors = errors_of(path, ["--model.num_layers=4"])
    file = os.path.join(str(ckpt), MODEL_CONFIG_FILE)
    assert sorted(errors) == sorted([
        f"{path}:10: model.rotary_base: the recipe says 10000.0, {file} says 1000000.0",
        f"{path}:11: model.norm_epsilon: the recipe says 1e-05, {file} says 1e-06",
        f"{path}:12: model.moe_router_topk: the recipe says 4, {file} says 2",
        f"{path}:13: model.moe_router_pre_softmax: the recipe says true, {file} says false",
        f"override '--model.num_layers=4': model.num_layers: the override says 4, {file} says 3",
    ])


def test_init_weights_from_an_override(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(None, [f"--checkpoint.init_weights={ckpt}"])
    assert cfg.model == CONVERTED
    errors = errors_of(None, [f"--checkpoint.init_weights={ckpt}", "--model.vocab_size=2000"])
    assert errors == [f"override '--model.vocab_size=2000': model.vocab_size: the override says "
                      f"2000, {ckpt / MODEL_CONFIG_FILE} says 1000"]


def test_a_known_preset_must_agree_with_the_file(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    path = recipe(tmp_path, ckpt, "preset: qwen3-30b-a3b\n")
    errors = errors_of(path)
    assert f"{path}:10: model.num_layers: preset 'qwen3-30b-a3b' says 48, " \
           f"{ckpt / MODEL_CONFIG_FILE} says 3" in errors
    # A converted Qwen3-30B-A3B agrees with its preset: the name is kept as the label.
    qwen = ModelConfig(**{**MODEL_PRESETS["qwen3-30b-a3b"], "preset": "hf", "seq_length": 40960})
    ckpt = converted_dir(tmp_path, qwen, name="qwen")
    cfg = load_config(recipe(tmp_path, ckpt, "preset: qwen3-30b-a3b\n", "q.yaml"))
    assert cfg.model == dataclasses.replace(qwen, preset="qwen3-30b-a3b")


@pytest.mark.parametrize("override, field, value", [
    ("--model.seq_length=2048", "seq_length", 2048),
    ("--model.moe_aux_loss_coeff=0.01", "moe_aux_loss_coeff", 0.01),
    ("--model.moe_token_dispatcher_type=allgather", "moe_token_dispatcher_type", "allgather"),
    ("--model.moe_router_dtype=fp64", "moe_router_dtype", "fp64"),
    ("--model.init_method_std=0.01", "init_method_std", 0.01),
])
def test_training_fields_are_free(tmp_path: Path, override: str, field: str, value) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(recipe(tmp_path, ckpt), [override])
    assert getattr(cfg.model, field) == value
    assert cfg.model == dataclasses.replace(CONVERTED, **{field: value})
    validate_config(cfg, world_size=1)


def test_seq_length_still_checked_against_the_lengths(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(recipe(tmp_path, ckpt), ["--model.seq_length=128"])
    with pytest.raises(ConfigError, match=r"model.seq_length \(128\) must be >="):
        validate_config(cfg, world_size=1)


def test_without_model_config_json_nothing_changes(tmp_path: Path) -> None:
    sft = tmp_path / "sft_weights"  # what gspo-train saves: weights only
    sft.mkdir()
    cfg = load_config(recipe(tmp_path, sft, "preset: tiny\nseq_length: 4096\n"))
    assert cfg.model == ModelConfig(seq_length=4096)
    validate_config(cfg, world_size=1)


def _drop_norm_epsilon(meta: dict) -> str:
    del meta["norm_epsilon"]
    return json.dumps(meta)


MALFORMED = {
    # name: (new file text from the converter's dict, message regex)
    "bad json": (lambda meta: '{"num_layers": 3,\n "hidden_size": }',
                 r"model_config.json:2: invalid JSON: Expecting value"),
    "not an object": (lambda meta: "[1, 2]",
                      r"model_config.json: must be a JSON object of ModelConfig fields, got list"),
    "unknown field": (lambda meta: json.dumps({**meta, "num_layrs": 3}),
                      r"model_config.json: num_layrs: unknown ModelConfig field; "
                      r"did you mean 'num_layers'\?"),
    "wrong type": (lambda meta: json.dumps({**meta, "rotary_base": "fast"}),
                   r"model_config.json: rotary_base: expected float.*got 'fast'"),
    "wrong bool": (lambda meta: json.dumps({**meta, "moe_router_pre_softmax": "maybe"}),
                   r"model_config.json: moe_router_pre_softmax: expected bool"),
    "missing field": (_drop_norm_epsilon,
                      r"model_config.json: missing architecture field\(s\) norm_epsilon$"),
    "inconsistent": (lambda meta: json.dumps({**meta, "moe_router_topk": 16}),
                     r"model_config.json: model.moe_router_topk must be <= model.num_moe_experts"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_model_config_json(tmp_path: Path, case: str) -> None:
    rewrite, message = MALFORMED[case]
    ckpt = converted_dir(tmp_path)
    meta = json.loads((ckpt / MODEL_CONFIG_FILE).read_text())
    (ckpt / MODEL_CONFIG_FILE).write_text(rewrite(meta))
    errors = errors_of(recipe(tmp_path, ckpt))
    assert len(errors) == 1, errors
    assert errors[0].startswith(str(ckpt / MODEL_CONFIG_FILE))
    assert re.search(message, errors[0]), errors[0]


def test_training_fields_may_be_missing_from_the_file(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    meta = json.loads((ckpt / MODEL_CONFIG_FILE).read_text())
    for field in TRAINING_FIELDS:
        del meta[field]
    (ckpt / MODEL_CONFIG_FILE).write_text(json.dumps(meta))
    cfg = load_config(recipe(tmp_path, ckpt), ["--model.seq_length=4096"])
    assert cfg.model.preset == "converted"  # the directory's name
    assert all(getattr(cfg.model, f) == getattr(CONVERTED, f) for f in ARCHITECTURE_FIELDS)


# ------------------------------------------------------------------------------- preset labels


def test_preset_label_from_the_file_or_the_recipe(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path, preset="Qwen/Qwen3-30B-A3B-Base")
    assert load_config(recipe(tmp_path, ckpt)).model.preset == "Qwen/Qwen3-30B-A3B-Base"
    cfg = load_config(recipe(tmp_path, ckpt, "preset: my-qwen-sft\n", "b.yaml"))
    assert cfg.model == dataclasses.replace(CONVERTED, preset="my-qwen-sft")


def test_free_label_with_every_shape_field_set(tmp_path: Path) -> None:
    shape = {f: getattr(CONVERTED, f) for f in SHAPE_FIELDS}
    overrides = ["--model.preset=my-model"] + [
        f"--model.{k}={json.dumps(v)}" for k, v in shape.items()]
    cfg = load_config(None, overrides)
    assert cfg.model.preset == "my-model"
    assert {f: getattr(cfg.model, f) for f in SHAPE_FIELDS} == shape


def test_free_label_without_a_shape_is_refused(tmp_path: Path) -> None:
    errors = errors_of(None, ["--model.preset=my-model", "--model.num_layers=3"])
    assert len(errors) == 1
    assert "model.preset: unknown preset 'my-model'" in errors[0]
    assert "free label" in errors[0] and "missing model.hidden_size" in errors[0]
    assert "model.num_layers," not in errors[0]


def test_validate_config_compares_a_config_built_in_python(tmp_path: Path) -> None:
    ckpt = converted_dir(tmp_path)
    cfg = load_config(recipe(tmp_path, ckpt))
    cfg.model.rotary_base = 10000.0
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=1)
    assert (f"model.rotary_base: the config says 10000.0, {ckpt / MODEL_CONFIG_FILE} says "
            "1000000.0") in info.value.errors


# ------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("edit, args, message", [
    ({}, ["--model.rotary_base=10000", "--model.norm_epsilon=1e-5"],
     "model.rotary_base: the override says 10000.0, {file} says 1000000.0"),
    ({"rotary_base": "fast"}, [], "{file}: rotary_base: expected float"),
])
def test_cli_refuses_with_exit_2_and_writes_nothing(tmp_path: Path, edit, args, message) -> None:
    ckpt = converted_dir(tmp_path, **edit)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_megatron.cli", "--config", recipe(tmp_path, ckpt),
         f"--logging.run_dir={run_dir}", *args],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message.format(file=ckpt / MODEL_CONFIG_FILE) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("gspo-train: error:")
    if not args[1:]:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    else:  # two fields: ConfigError's "2 configuration errors:" list, one line each
        assert "model.norm_epsilon: the override says 1e-05" in proc.stderr
    assert not run_dir.exists()
