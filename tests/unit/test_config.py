"""Config loading, overrides, cross-field validation, save/load round trip, and the recipes."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import warnings
from pathlib import Path

import pytest

from gspo_megatron.algorithms import LOSSES, PolicyLossConfig
from gspo_megatron.algorithms.losses.gspo import GSPOParams
from gspo_megatron.config import (DEMO_RECIPE, DataConfig, LoggingConfig, OptimConfig,
                                  RolloutConfig, SFTConfig, TrainConfig)
from gspo_megatron.config.loader import (
    ConfigError,
    ConfigWarning,
    config_from_argv,
    config_to_dict,
    describe_config,
    field_docs,
    load_config,
    parse_cli,
    save_config,
    section_types,
    validate_config,
)
from gspo_megatron.config.model import MODEL_PRESETS, ModelConfig, model_config_from_preset

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "configs"

# recipe -> the world size it is written for
RECIPE_WORLD_SIZES = {
    "tiny_gspo.yaml": 1,
    "tiny_grpo.yaml": 1,
    "tiny_grpo_r2.yaml": 1,
    "tiny_tool_gspo.yaml": 1,
    "qwen3_30b_a3b_gspo.yaml": 16,
    "qwen3_30b_a3b_gspo_16k.yaml": 16,
    "qwen3_30b_a3b_grpo.yaml": 16,
    "qwen3_235b_a22b_gspo.yaml": 128,
    "gpu_qwen3_slice_rl.yaml": 1,
    "routing_study.yaml": 1,
}


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return str(path)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def demo(*overrides: str):
    """The CPU demo recipe (a valid run on one process) with overrides."""
    return load_config(DEMO_RECIPE, list(overrides))


# ------------------------------------------------------------------------------------ defaults


def test_defaults_load_and_only_lack_a_model_long_enough() -> None:
    """The library's defaults are production's; the model's are the tiny shape (there is no
    default production model), too short for the production lengths: a recipe names a model."""
    cfg = load_config(None)
    assert cfg == TrainConfig()
    err = pytest.raises(ConfigError, validate_config, cfg).value
    assert err.errors == ["model.seq_length (64) must be >= data.max_prompt_length + "
                          "rollout.max_new_tokens = 1024 + 1024 = 2048"]
    assert validate_config(load_config(None, ["--model.seq_length=2048"])) == 1


def test_empty_file_and_empty_section_are_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == TrainConfig()
    assert load_config(write(tmp_path, "rollout:\nsft:\n", "b.yaml")) == TrainConfig()


def test_defaults_are_the_papers_and_productions() -> None:
    cfg = TrainConfig()
    assert cfg.loss == PolicyLossConfig()  # GSPO, the paper's eps (Sec. 5.1)
    assert (cfg.loss.variant, cfg.loss.eps_low, cfg.loss.eps_high) == ("gspo", 3e-4, 4e-4)
    assert cfg.sft.steps == 0  # a pretrained policy: no supervised warm-up
    o = cfg.optim  # RL fine-tuning (verl / slime): AdamW, constant 1e-6, no warm-up
    assert (o.lr, o.lr_decay_style, o.lr_warmup_steps, o.weight_decay, o.clip_grad) == (
        1e-6, "constant", 0, 0.01, 1.0)
    assert (cfg.rollout.max_new_tokens, cfg.data.max_prompt_length) == (1024, 1024)
    assert cfg.logging.run_dir == "runs/gspo"


def test_recipe_without_loss_optim_sft_gets_the_paper_eps_and_no_sft(tmp_path: Path) -> None:
    path = write(tmp_path, """
        model:
          preset: tiny
          seq_length: 2048
        rollout:
          group_size: 4
    """)
    cfg = load_config(path)
    validate_config(cfg)
    assert (cfg.loss.variant, cfg.loss.eps_low, cfg.loss.eps_high) == ("gspo", 3e-4, 4e-4)
    assert cfg.sft.steps == 0 and cfg.optim == TrainConfig().optim


# The library's defaults before they became production's: `gspo-train` without --config must run
# exactly this (the demo's metrics are compared bitwise).
OLD_DEFAULTS = TrainConfig(
    model=model_config_from_preset("tiny", seq_length=64),  # not tiny_gspo.yaml's 16
    optim=OptimConfig(lr=3e-4, min_lr=3e-5, lr_warmup_steps=20, lr_decay_style="cosine"),
    # The demo's eps 1e-2 under the losses that read them (loss.gspo, loss.gspo_token), so that
    # --loss.variant=OTHER runs OTHER at its defaults; GSPO resolves to the same knobs as before.
    loss=PolicyLossConfig(variant="gspo", gspo=GSPOParams(clip_low=1e-2, clip_high=1e-2),
                          gspo_token=GSPOParams(clip_low=1e-2, clip_high=1e-2)),
    data=DataConfig(max_prompt_length=8),
    rollout=RolloutConfig(max_new_tokens=4),
    sft=SFTConfig(steps=300, batch_size=64, lr=3e-3),
    logging=LoggingConfig(run_dir="runs/demo"),
)  # every other field: the (unchanged) defaults


def test_demo_recipe_is_the_old_defaults() -> None:
    cfg = load_config(DEMO_RECIPE)
    assert config_to_dict(cfg) == config_to_dict(OLD_DEFAULTS)
    assert cfg == OLD_DEFAULTS
    assert cfg.loss.params == PolicyLossConfig(variant="gspo", clip_low=1e-2, clip_high=1e-2).params
    assert validate_config(cfg) == 1
    assert Path(DEMO_RECIPE).is_absolute() and Path(DEMO_RECIPE).is_file()
    # gspo-train with no arguments resolves the demo.
    assert config_from_argv([]) == cfg
    assert config_from_argv(["--trainer.steps=5"]).trainer.steps == 5


def test_demo_recipe_is_package_data() -> None:
    root = Path(__file__).resolve().parents[2]
    setup_py = (root / "setup.py").read_text(encoding="utf-8")
    assert '"gspo_megatron.config": ["recipes/*.yaml"]' in setup_py
    assert Path(DEMO_RECIPE).parent == root / "gspo_megatron" / "config" / "recipes"


# ------------------------------------------------------------------------------------- recipes


def test_every_recipe_is_listed() -> None:
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(RECIPE_WORLD_SIZES)


@pytest.mark.parametrize("name", sorted(RECIPE_WORLD_SIZES))
def test_recipe_loads_and_validates_for_its_world_size(name: str) -> None:
    cfg = load_config(RECIPES / name)
    world = RECIPE_WORLD_SIZES[name]
    cluster = cfg.data.source == "file"  # cluster recipes point at data/checkpoints elsewhere
    dp = validate_config(cfg, world_size=world, check_paths=not cluster)
    p = cfg.parallel
    assert dp * p.tensor_model_parallel_size * p.pipeline_model_parallel_size * \
        p.context_parallel_size == world
    variant = "grpo" if "grpo" in name else "gspo"
    assert cfg.loss.variant == variant
    # GSPO: the paper's eps for real models; the tiny demo's 2-3-token responses use 1e-2
    # (see the comment in tiny_gspo.yaml).
    expected = (0.2, 0.27) if variant == "grpo" else (1e-2, 1e-2) if name.startswith("tiny") else (3e-4, 4e-4)
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == pytest.approx(expected)
    if world > 1:
        # A model-parallel recipe does not fit the wrong world size.
        with pytest.raises(ConfigError):
            validate_config(cfg, world_size=world // 2 + 1, check_paths=False)


@pytest.mark.parametrize("name", sorted(n for n in RECIPE_WORLD_SIZES if n.startswith("tiny"))
                         + ["routing_study.yaml", "demo"])
def test_tiny_recipe_builds_its_data(name: str) -> None:
    """The CPU recipes run as committed: their built-in datasets can be drawn (validate_config does
    not draw them; a recipe asking for more unique problems than the task has used to fail at
    startup)."""
    from gspo_megatron import cli

    load_data = getattr(cli, "load_data", None) or cli.setup_tokenizer_and_data
    cfg = load_config(DEMO_RECIPE if name == "demo" else RECIPES / name)
    _, train, heldout = load_data(cfg)
    assert len(train) == cfg.data.num_train_examples and len(heldout) == cfg.data.num_eval_examples


def test_data_seed_fixes_the_problems_while_the_rl_seed_changes() -> None:
    """data.seed (the routing study's seeds): the same problems whatever trainer.seed; unset, the
    problem sets follow trainer.seed as before."""
    from gspo_megatron.cli import load_data

    def prompts(*overrides):
        _, train, heldout = load_data(load_config(RECIPES / "routing_study.yaml", overrides))
        return [e.prompt for e in train + heldout]

    fixed = prompts("--data.seed=9", "--trainer.seed=1")
    assert fixed == prompts("--data.seed=9", "--trainer.seed=2")
    assert prompts("--trainer.seed=1") != prompts("--trainer.seed=2")
    assert prompts("--trainer.seed=9") == fixed


def test_qwen_recipes_use_their_preset_and_math_data() -> None:
    for name, preset in (("qwen3_30b_a3b_gspo.yaml", "qwen3-30b-a3b"),
                         ("qwen3_30b_a3b_grpo.yaml", "qwen3-30b-a3b"),
                         ("qwen3_235b_a22b_gspo.yaml", "qwen3-235b-a22b")):
        cfg = load_config(RECIPES / name)
        shape = {k: v for k, v in MODEL_PRESETS[preset].items() if k != "seq_length"}
        assert {k: getattr(cfg.model, k) for k in shape} == shape
        assert cfg.tokenizer.kind == "hf" and cfg.tokenizer.path.startswith("Qwen/Qwen3-")
        assert cfg.data.answer_key == "reward_model.ground_truth"
        assert cfg.reward.fn == "math_verify"
        assert cfg.precision.bf16 and cfg.optim.use_distributed_optimizer
        assert cfg.rollout.group_size == 16 and cfg.trainer.num_minibatches == 4
        assert cfg.optim.lr == pytest.approx(1e-6)


def test_gspo_and_grpo_30b_recipes_differ_only_in_the_loss_and_names() -> None:
    a = config_to_dict(load_config(RECIPES / "qwen3_30b_a3b_gspo.yaml"))
    b = config_to_dict(load_config(RECIPES / "qwen3_30b_a3b_grpo.yaml"))
    diff = {(s, k) for s in a for k in a[s] if a[s][k] != b[s][k]}
    assert {s for s, _ in diff} <= {"loss", "checkpoint", "logging"}


def test_cluster_recipe_path_check(tmp_path: Path) -> None:
    cfg = load_config(RECIPES / "qwen3_30b_a3b_gspo.yaml",
                      [f"--checkpoint.init_weights={tmp_path}"])
    msg = error_of(validate_config, cfg, 16)
    assert "data.train_path: no such file" in msg
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    cfg = load_config(RECIPES / "qwen3_30b_a3b_gspo.yaml",
                      [f"--data.train_path={data}", f"--checkpoint.init_weights={tmp_path}"])
    assert validate_config(cfg, 8) == 2  # one node: TP4 -> DP 2
    assert validate_config(cfg, 16) == 4


# ----------------------------------------------------------------------------------- overrides


def test_overrides_of_every_scalar_kind() -> None:
    cfg = load_config(None, [
        "--rollout.group_size=4",            # int
        "rollout.temperature=0.7",           # float, no dashes
        "--optim.lr=3e-4",                   # float in e-notation (a string to YAML 1.1)
        "--sft.lr=1_000",                    # int literal for a float field
        "--trainer.reference_model=true",    # bool
        "--logging.progress=False",          # bool, any case
        "--logging.run_dir=runs/007",        # str stays verbatim
        "--logging.wandb_project=2024",      # str | None given digits
        "--checkpoint.save_dir=/tmp/ck",     # str | None
        "--model.kv_channels=null",          # int | None -> None
        "--model.moe_router_dtype=none",     # Literal | None -> None
        "--precision.fp8=e4m3",              # Literal | None
        "--loss.variant=grpo",               # Literal
        "--loss.clip_high=0.28",             # float | None
        "--loss.kl_coef=0.01",
        "--data.source=file",
        "--data.train_path=prompts.jsonl",   # required with source 'file'
    ])
    assert cfg.rollout.group_size == 4 and isinstance(cfg.rollout.group_size, int)
    assert cfg.rollout.temperature == 0.7
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.sft.lr == 1000.0 and isinstance(cfg.sft.lr, float)
    assert cfg.trainer.reference_model is True
    assert cfg.logging.progress is False
    assert cfg.logging.run_dir == "runs/007"
    assert cfg.logging.wandb_project == "2024"
    assert cfg.checkpoint.save_dir == "/tmp/ck"
    assert cfg.model.kv_channels is None
    assert cfg.model.moe_router_dtype is None
    assert cfg.precision.fp8 == "e4m3"
    # clip_low keeps the default (None: the paper's eps for the variant), the rest is overridden
    assert cfg.loss == PolicyLossConfig(variant="grpo", clip_high=0.28, kl_coef=0.01)
    assert cfg.data.source == "file" and cfg.data.train_path == "prompts.jsonl"


def test_override_wins_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
        rollout:
          group_size: 8
          top_p: 0.9
    """)
    cfg = load_config(path, ["--rollout.group_size=2"])
    assert cfg.rollout.group_size == 2 and cfg.rollout.top_p == 0.9


def test_float_in_e_notation_from_yaml(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "optim:\n  lr: 3e-4\nloss:\n  clip_low: 3e-4\n"))
    assert cfg.optim.lr == 3e-4 and cfg.loss.clip_low == 3e-4


@pytest.mark.parametrize("text, expected", [
    ("[1,0,1,1]", [1, 0, 1, 1]),
    ("[1, 0, 1, 1]", [1, 0, 1, 1]),
    ("1,0,1,1", [1, 0, 1, 1]),
    ("2", 2),
])
def test_moe_layer_freq_list_or_int(text: str, expected) -> None:
    cfg = demo("--model.num_layers=4", f"--model.moe_layer_freq={text}")
    assert cfg.model.moe_layer_freq == expected
    assert type(cfg.model.moe_layer_freq) is type(expected)
    validate_config(cfg)


def test_moe_layer_freq_list_from_yaml(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model:\n  num_layers: 3\n  moe_layer_freq: [0, 1, 1]\n"))
    assert cfg.model.moe_layer_freq == [0, 1, 1]
    assert cfg.model.layer_is_moe() == [False, True, True]
    msg = error_of(load_config, None, ["--model.moe_layer_freq=[1,x]"])
    assert "model.moe_layer_freq" in msg and "list of int or int" in msg


def test_bad_override_syntax() -> None:
    assert "section.field" in error_of(load_config, None, ["--rollout=3"])
    assert "expected --section.field=value" in error_of(load_config, None, ["--rollout.group_size"])
    assert "section.field" in error_of(load_config, None, ["--a.b.c.d=1"])
    assert "rollout.group_size: expected int" in error_of(load_config, None,
                                                          ["--rollout.group_size.x=1"])


# ------------------------------------------------------------------------------------- presets


def test_preset_fills_fields_and_explicit_keys_win(tmp_path: Path) -> None:
    path = write(tmp_path, """
        model:
          seq_length: 8192
          preset: qwen3-30b-a3b
          num_layers: 4
    """)
    cfg = load_config(path)
    expected = ModelConfig(**{**MODEL_PRESETS["qwen3-30b-a3b"], "preset": "qwen3-30b-a3b",
                              "seq_length": 8192, "num_layers": 4})
    assert cfg.model == expected
    # An override beats both the preset and the file.
    cfg = load_config(path, ["--model.hidden_size=1024"])
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 4
    assert cfg.model.num_moe_experts == 128


def test_preset_from_override_only() -> None:
    cfg = load_config(None, ["--model.preset=qwen3-235b-a22b", "--model.num_layers=2"])
    assert cfg.model.hidden_size == MODEL_PRESETS["qwen3-235b-a22b"]["hidden_size"]
    assert cfg.model.num_layers == 2


def test_unknown_preset_suggests(tmp_path: Path) -> None:
    msg = error_of(load_config, write(tmp_path, "model:\n  preset: qwen3-30b-a3\n"))
    assert "recipe.yaml:2: model.preset: unknown preset 'qwen3-30b-a3'" in msg
    assert "did you mean 'qwen3-30b-a3b'" in msg
    # Any other name is a free label, once the shape comes from elsewhere (here: every shape
    # field; or checkpoint.init_weights' model_config.json, tests/unit/test_init_from_converted.py).
    assert "free label" in msg and "missing model.num_layers" in msg
    shape = {k: v for k, v in MODEL_PRESETS["tiny"].items() if k != "seq_length"}
    cfg = load_config(None, ["--model.preset=my-tiny-moe",
                             *(f"--model.{k}={v}" for k, v in shape.items())])
    assert cfg.model == ModelConfig(preset="my-tiny-moe")


# -------------------------------------------------------------------------------- load errors


def test_unknown_field_has_line_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, """
        # a comment
        model:
          preset: tiny

        rollout:
          temperature: 1.0
          group_szie: 4
    """, name="tiny.yaml")
    msg = error_of(load_config, path)
    assert f"{path}:7: rollout.group_szie: unknown field; did you mean 'group_size'?" in msg


def test_unknown_section_has_line_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  num_layers: 2\nrolout:\n  group_size: 4\n")
    msg = error_of(load_config, path)
    assert f"{path}:3: rolout: unknown section; did you mean 'rollout'?" in msg


def test_unknown_override_field_and_section() -> None:
    msg = error_of(load_config, None, ["--trainer.num_minibatch=2"])
    assert "override '--trainer.num_minibatch=2': trainer.num_minibatch: unknown field" in msg
    assert "did you mean 'num_minibatches'" in msg
    assert "did you mean 'optim'" in error_of(load_config, None, ["--optimm.lr=1"])


@pytest.mark.parametrize("field, value, expected", [
    ("rollout.group_size", "eight", "expected int"),
    ("rollout.group_size", "2.5", "expected int"),
    ("rollout.group_size", "true", "expected int"),
    ("rollout.temperature", "hot", "expected float"),
    ("rollout.temperature", ".nan", "expected a finite float"),
    ("trainer.reference_model", "maybe", "expected bool"),
    ("model.kv_channels", "wide", "expected int or null"),
    ("logging.progress", "[1]", "expected bool"),
])
def test_wrong_type_names_field_value_and_source(field: str, value: str, expected: str) -> None:
    msg = error_of(load_config, None, [f"--{field}={value}"])
    assert f"override '--{field}={value}': {field}: {expected}" in msg


def test_wrong_type_in_file_has_line(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n  max_new_tokens: lots\n")
    msg = error_of(load_config, path)
    assert f"{path}:3: rollout.max_new_tokens: expected int, got 'lots'" in msg


def test_bad_literal(tmp_path: Path) -> None:
    msg = error_of(load_config, None, ["--loss.variant=gpso"])
    assert "loss.variant: expected one of 'gspo', 'gspo_token', 'grpo'" in msg
    assert "did you mean 'gspo'" in msg and "got 'gpso'" in msg
    path = write(tmp_path, "trainer:\n  old_logprobs: rollouts\n")
    msg = error_of(load_config, path)
    assert f"{path}:2: trainer.old_logprobs: expected one of 'recompute', 'rollout'" in msg


@pytest.mark.parametrize("override, suggestion", [
    ("--loss.variant=GSPO", "gspo"),              # PolicyLossConfig's Literal, via a module alias
    ("--loss.variant=Grpo", "grpo"),
    ("--loss.aggregation=TOKEN_MEAN", "token_mean"),
    ("--optim.lr_decay_style=Cosine", "cosine"),
    ("--routing.replay=R2", "r2"),
    ("--precision.fp8=E4M3", "e4m3"),             # Literal | None
    ("--model.preset=Qwen3-30B-A3B", "qwen3-30b-a3b"),
])
def test_enum_values_suggest_across_case(override: str, suggestion: str) -> None:
    msg = error_of(load_config, None, [override])
    assert f"; did you mean {suggestion!r}?" in msg and msg.count(override) == 1


def test_loss_constructor_errors_name_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, "loss:\n  variant: gspo\n  aggregation: token_mean\n")
    msg = error_of(load_config, path)
    assert f"{path}:3: loss.aggregation:" in msg
    assert "'token_mean' is not an aggregation of variant='gspo'" in msg
    msg = error_of(load_config, None, ["--loss.clip_low=1.5"])
    assert msg.startswith("override '--loss.clip_low=1.5': loss.clip_low: must be < 1")
    assert msg.count("got 1.5") == 1  # the value once


def test_all_errors_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_szie: 4\n  top_p: high\ntrainer:\n  stepz: 3\n")
    err = pytest.raises(ConfigError, load_config, path).value
    assert len(err.errors) == 3
    assert [e.split(": ")[1] for e in err.errors] == [
        "rollout.group_szie", "rollout.top_p", "trainer.stepz"]


def test_duplicate_keys_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n  group_size: 8\n")
    assert f"{path}:3: rollout.group_size: duplicate field" in error_of(load_config, path)


def test_structure_errors(tmp_path: Path) -> None:
    assert "top level must be a mapping" in error_of(load_config, write(tmp_path, "- 1\n- 2\n"))
    msg = error_of(load_config, write(tmp_path, "rollout: 4\n", "b.yaml"))
    assert "b.yaml:1: rollout: a section must be a mapping" in msg
    msg = error_of(load_config, write(tmp_path, "rollout:\n  group_size: [4\n", "c.yaml"))
    assert "c.yaml:" in msg and "invalid YAML" in msg
    assert "cannot read" in error_of(load_config, str(tmp_path / "missing.yaml"))


def test_python_object_tag_is_rejected(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write(tmp_path, f"""
        rollout:
          group_size: !!python/object/apply:os.system ["touch {marker}"]
    """)
    msg = error_of(load_config, path)
    assert "recipe.yaml:2" in msg and "python/object" in msg
    assert not marker.exists()
    path = write(tmp_path, "logging: !!python/object:gspo_megatron.config.LoggingConfig {}\n", "b.yaml")
    assert "python/object" in error_of(load_config, path)


# ------------------------------------------------------------------------ the sections' checks


@pytest.mark.parametrize("override, text", [
    ("--rollout.group_size=1", "rollout.group_size: must be >= 2 (GSPO/GRPO advantages"),
    ("--rollout.prompts_per_step=0", "rollout.prompts_per_step: must be >= 1, got 0"),
    ("--rollout.temperature=0", "rollout.temperature: must be > 0 (greedy decoding is "
                                "rollout.top_k: 1), got 0.0"),
    ("--rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
    ("--rollout.top_p=1.5", "rollout.top_p: must be in (0, 1], got 1.5"),
    ("--rollout.top_k=-1", "rollout.top_k: must be >= 0 (0 = off), got -1"),
    ("--checkpoint.keep_last=0", "checkpoint.keep_last: must be >= 1, got 0"),
    ("--checkpoint.save_interval=-1", "checkpoint.save_interval: must be >= 0"),
    ("--data.source=file", "data.train_path: is required when data.source is 'file'"),
    ("--data.max_prompt_length=0", "data.max_prompt_length: must be >= 1, got 0"),
    ("--data.heldout_fraction=1", "data.heldout_fraction: must be in (0, 1), got 1.0"),
    ("--data.answer_key=", "data.answer_key: must be a non-empty field name"),
    ("--tokenizer.kind=hf", "tokenizer.path: is required when tokenizer.kind is 'hf'"),
    ("--model.num_query_groups=3", "model.num_query_groups: must divide "
                                   "model.num_attention_heads (4), got 3"),
    ("--model.moe_router_topk=5", "model.moe_router_topk: must be <= model.num_moe_experts (4)"),
    ("--model.moe_layer_freq=[1,0,1]", "model.moe_layer_freq: must have one entry per layer"),
    ("--model.seq_length=0", "model.seq_length: must be >= 1, got 0"),
    ("--parallel.tensor_model_parallel_size=0", "parallel.tensor_model_parallel_size: must be >= 1"),
    ("--precision.fp8=e4m3", None),  # valid alone (transformer_impl 'auto')
    ("--optim.lr=0", "optim.lr: must be > 0, got 0.0"),
    ("--optim.min_lr=1", "optim.min_lr: must be <= optim.lr (1e-06), got 1.0"),
    ("--optim.adam_beta2=1", "optim.adam_beta2: must be in [0, 1), got 1.0"),
    ("--optim.adam_eps=0", "optim.adam_eps: must be > 0"),
    ("--optim.lr_decay_steps=0", "optim.lr_decay_steps: must be >= 1 or null, got 0"),
    ("--sft.lr=0", "sft.lr: must be > 0"),
    ("--sft.batch_size=0", "sft.batch_size: must be >= 1"),
    ("--reward.timeout_s=0", "reward.timeout_s: must be > 0"),
    ("--trainer.max_consecutive_faults=0", "trainer.max_consecutive_faults: must be >= 1"),
    ("--trainer.micro_batch_size=0", "trainer.micro_batch_size: must be >= 1"),
    ("--routing.diagnostics_interval=0", "routing.diagnostics_interval: must be >= 1"),
    ("--logging.run_dir=", "logging.run_dir: must be a non-empty path"),
    ("--logging.tensorboard_dir=runs/tb", None),
])
def test_section_checks_run_at_load_and_point_at_the_override(override: str, text) -> None:
    if text is None:
        load_config(None, [override])
        return
    msg = error_of(load_config, None, [override])
    assert msg.startswith(f"override {override!r}: {text}"), msg


def test_section_check_points_at_the_recipe_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        model:
          preset: tiny
        rollout:
          group_size: 8
          top_p: 1.5
        precision:
          transformer_impl: local
          fp8: hybrid
    """)
    err = pytest.raises(ConfigError, load_config, path).value
    assert err.errors == [  # in TrainConfig's section order
        f"{path}:8: precision.fp8: needs Transformer Engine (precision.transformer_impl 'auto' or "
        "'transformer_engine', not 'local'), got 'hybrid'",
        f"{path}:5: rollout.top_p: must be in (0, 1], got 1.5",
    ]
    # A preset's value is blamed only when the recipe set none of the fields involved.
    path = write(tmp_path, "model:\n  preset: tiny\n  num_attention_heads: 5\n", "b.yaml")
    assert error_of(load_config, path).startswith(f"{path}:3: model.num_query_groups: must divide")


def test_top_k_and_top_p_cannot_both_be_active() -> None:
    msg = error_of(load_config, None, ["--rollout.top_k=5", "--rollout.top_p=0.9"])
    assert "rollout.top_k and rollout.top_p cannot both be active" in msg
    load_config(None, ["--rollout.top_k=1", "--rollout.top_p=0.9"])  # greedy: top_p is moot
    load_config(None, ["--rollout.top_k=40"])
    load_config(None, ["--rollout.top_p=0.9"])


def test_sections_check_themselves_when_built_directly() -> None:
    from gspo_megatron.config import FieldError

    with pytest.raises(ValueError, match=r"^rollout.temperature must be > 0"):
        RolloutConfig(temperature=0.0)  # greedy is top_k=1, not temperature 0
    with pytest.raises(FieldError) as info:
        RolloutConfig(top_p=2.0, group_size=1)
    assert [fields for fields, _ in info.value.problems] == [("group_size",), ("top_p",)]
    with pytest.raises(ValueError, match="optim.lr_decay_style must be one of 'constant', "
                                         "'linear', 'cosine', got 'cosin'"):
        OptimConfig(lr_decay_style="cosin")
    with pytest.raises(ValueError, match="model.num_layers must be >= 1, got 0"):
        ModelConfig(num_layers=0)
    with pytest.raises(ValueError, match="logging.tensorboard_dir must be a non-empty path"):
        LoggingConfig(tensorboard_dir="")  # (on the command line an empty value is null: off)


def test_all_section_errors_reported_together() -> None:
    err = pytest.raises(ConfigError, load_config, None, [
        "--rollout.top_p=2", "--checkpoint.keep_last=0", "--rollout.temperature=0"]).value
    assert len(err.errors) == 3


def test_validate_rechecks_sections_changed_in_place() -> None:
    cfg = demo()
    cfg.rollout.temperature = 0.0
    assert error_of(validate_config, cfg) == (
        "rollout.temperature must be > 0 (greedy decoding is rollout.top_k: 1), got 0.0")


# ------------------------------------------------------------------------ cross-section checks


def test_packing_is_the_default_where_it_runs() -> None:
    """Padding-free training by default: a budget of micro_batch_size x seq_length (what a padded
    microbatch holds); padded where packing cannot run, or when opted out; an explicit budget
    with the opt-out is refused by name."""
    from gspo_megatron.config import token_budget

    assert token_budget(demo()) == 16 * 64
    assert token_budget(demo("--trainer.max_tokens_per_microbatch=300")) == 300
    assert token_budget(demo("--trainer.pack_sequences=false")) is None
    assert token_budget(demo("--precision.local_kernels=false",
                             "--precision.transformer_impl=local")) is None
    msg = error_of(validate_config, demo("--trainer.pack_sequences=false",
                                         "--trainer.max_tokens_per_microbatch=300"))
    assert "trainer.max_tokens_per_microbatch=300 is a packed microbatch's budget, but " \
           "trainer.pack_sequences=false trains padded microbatches" in msg


def test_divisibility_errors_name_fields_and_numbers() -> None:
    cfg = demo("--rollout.prompts_per_step=3", "--rollout.group_size=5",
               "--trainer.num_minibatches=4")
    msg = error_of(validate_config, cfg)
    assert ("trainer.num_minibatches (4) must divide the rollout batch "
            "rollout.prompts_per_step x rollout.group_size = 3 x 5 = 15") in msg
    # padded microbatches split the minibatch; packed ones (the default) need not
    cfg = demo("--trainer.micro_batch_size=5", "--trainer.pack_sequences=false")  # 16 x 8 / 4
    msg = error_of(validate_config, cfg)
    assert "trainer.micro_batch_size (5) must divide the minibatch" in msg and "= 32" in msg
    validate_config(demo("--trainer.micro_batch_size=5"))
    cfg = demo("--sft.batch_size=63", "--parallel.expert_model_parallel_size=1")
    assert "sft.batch_size (63) must be divisible by the data-parallel size (2" in error_of(
        validate_config, cfg, 2)
    validate_config(demo("--sft.batch_size=63", "--sft.steps=0"), 2)  # no SFT: no constraint


@pytest.mark.parametrize("override, needle, world", [
    ("--loss.kl_coef=0.1", "loss.kl_coef = 0.1 > 0 needs trainer.reference_model", 1),
    ("--reward.fn=no_such_reward", "reward.fn = 'no_such_reward'", 1),
    ("--reward.fn=no_such_pkg.mod:fn", "reward.fn = 'no_such_pkg.mod:fn'", 1),
    ("--rollout.max_new_tokens=60", "model.seq_length (64) must be >= data.max_prompt_length + "
                                    "rollout.max_new_tokens = 8 + 60 = 68", 1),
    ("--parallel.expert_model_parallel_size=3", "parallel.expert_model_parallel_size (3) x "
                                                "expert_tensor_parallel_size (1) must divide", 1),
    ("--routing.replay=r3", "routing.replay='r3' needs an MoE model", 1),
    ("--parallel.context_parallel_size=3", "model.seq_length (64) must be divisible by TP x 2 "
                                           "x CP so sequence/context sharding is even", 3),
    ("--model.moe_layer_freq=[0,0]", "routing.diagnostics needs an MoE model", 1),
])
def test_validate_names_the_field(override: str, needle: str, world: int) -> None:
    cfg = demo(override, *(["--routing.diagnostics=true"] if "moe_layer" in override else []),
               *(["--model.moe_layer_freq=[0,0]"] if "r3" in override else []))
    err = pytest.raises(ConfigError, validate_config, cfg, world).value
    assert needle in str(err) and len(err.errors) == 1, err.errors


def test_validate_needs_nothing_built_and_leaves_the_config_alone() -> None:
    cfg = demo()
    before = config_to_dict(cfg)
    validate_config(cfg, world_size=4)
    assert config_to_dict(cfg) == before  # e.g. model.vocab_size is not adjusted here


def test_validate_world_size_layout() -> None:
    cfg = demo("--parallel.tensor_model_parallel_size=2")
    assert validate_config(cfg, world_size=4) == 2
    assert "world size 3 is not divisible" in error_of(validate_config, cfg, 3)
    assert "world size must be an int >= 1" in error_of(validate_config, cfg, 0)


def test_validate_collects_every_error() -> None:
    cfg = demo("--trainer.num_minibatches=3", "--loss.kl_coef=0.1", "--rollout.max_new_tokens=60")
    err = pytest.raises(ConfigError, validate_config, cfg).value
    assert len(err.errors) == 3


def test_data_file_exists_check(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    cfg = demo("--data.source=file", f"--data.train_path={missing}")
    assert "data.train_path: no such file" in error_of(validate_config, cfg)
    validate_config(cfg, check_paths=False)
    missing.write_text("{}\n")
    validate_config(cfg)


@pytest.mark.parametrize("args, message", [
    (["--rollout.engine=static"], "rollout.partial_rollouts with rollout.engine='static'"),
    (["--dynamic_sampling.enabled=true"], "with dynamic_sampling.enabled"),
    (["--rollout.in_flight_groups=3"], "rollout.in_flight_groups: must be >= "
                                       "rollout.prompts_per_step"),
])
def test_partial_rollouts_refuse_what_they_cannot_run(args, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(demo("--rollout.partial_rollouts=true", *args), world_size=2)


@pytest.mark.parametrize("value", ["0", "0.0005", "nan"])
def test_weight_bucket_holds_at_least_a_kib(value) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.weight_bucket_mb: must be at least 1/1024|"
                                          r"rollout\.weight_bucket_mb: expected a finite float"):
        validate_config(demo(f"--rollout.weight_bucket_mb={value}"))
    assert demo("--rollout.weight_bucket_mb=0.5").rollout.weight_bucket_bytes() == 1 << 19


def test_partial_keep_kv_needs_partial_rollouts() -> None:
    keep = ("--rollout.partial_rollouts=true", "--rollout.partial_keep_kv=true")
    with pytest.raises(ConfigError, match=re.escape(
            "rollout.partial_keep_kv needs rollout.partial_rollouts")):
        validate_config(demo(*keep, "--rollout.partial_rollouts=false"))
    validate_config(demo(*keep))
    validate_config(demo(*keep, "--rollout.placement=separate", "--rollout.ranks=1"),
                    world_size=2)


def test_r3_with_stale_rollouts_warns() -> None:
    separate = ("--rollout.placement=separate", "--rollout.ranks=1", "--routing.replay=r3")
    with pytest.warns(ConfigWarning, match="max_staleness=1: the replayed routes"):
        validate_config(demo(*separate), world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate_config(demo(*separate, "--rollout.max_staleness=0"), world_size=2)


def test_reference_model_without_kl_warns() -> None:
    cfg = demo("--trainer.reference_model=true")
    with pytest.warns(ConfigWarning, match="reference_model"):
        validate_config(cfg)
    validate_config(demo("--trainer.reference_model=true", "--loss.kl_coef=0.05"))


# ------------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("name", sorted(RECIPE_WORLD_SIZES))
def test_save_load_round_trip(tmp_path: Path, name: str) -> None:
    cfg = load_config(RECIPES / name, ["--model.moe_layer_freq=[1,0]" if "tiny" in name
                                       else "--optim.lr=3e-7"])
    out = tmp_path / "sub" / "config.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)


def test_round_trip_of_non_default_values(tmp_path: Path) -> None:
    cfg = load_config(None, ["--loss.variant=grpo", "--loss.aggregation=token_mean",
                             "--model.kv_channels=null", "--precision.fp8=hybrid",
                             "--logging.run_dir=007", "--optim.adam_eps=1e-12"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_loss_knobs_under_their_variant(tmp_path: Path) -> None:
    """A recipe's ``loss.<variant>`` block: read only while that loss runs; one key overridden
    with ``--loss.<variant>.<knob>``; a flat knob wins; bad keys and values name the block."""
    recipe = write(tmp_path, "loss:\n  variant: gspo\n  gspo: {clip_low: 1.0e-3, clip_high: 2.0e-3}\n"
                   "  sapo: {tau_neg: 1.2}\n")
    cfg = load_config(recipe)
    assert cfg.loss.params == GSPOParams(clip_low=1e-3, clip_high=2e-3)
    assert load_config(recipe, ["--loss.variant=grpo"]).loss.params == LOSSES["grpo"].params()
    assert load_config(recipe, ["--loss.variant=sapo"]).loss.params == LOSSES["sapo"].params(
        tau_neg=1.2)
    assert load_config(recipe, ["--loss.gspo.clip_low=5e-4"]).loss.params == GSPOParams(5e-4, 2e-3)
    assert load_config(recipe, ["--loss.clip_high=6e-4"]).loss.params == GSPOParams(1e-3, 6e-4)
    assert load_config(None, ["--loss.sapo.tau_pos=2"]).loss.sapo == LOSSES["sapo"].params(
        tau_pos=2.0)
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg
    assert "loss.gspo: unknown key 'clip_lo'" in error_of(
        load_config, recipe, ["--loss.gspo.clip_lo=1"]) and "did you mean 'clip_low'?" in error_of(
        load_config, recipe, ["--loss.gspo.clip_lo=1"])
    assert "loss.gspo.clip_low: must be < 1" in error_of(load_config, recipe,
                                                         ["--loss.gspo.clip_low=2"])
    # A block of a variant that is not running is still checked (it would fail when switched to).
    assert "loss.sapo.tau_pos: must be" in error_of(load_config, recipe, ["--loss.sapo.tau_pos=-1"])
    assert "is not section.field" in error_of(load_config, recipe, ["--loss.gspo.=1"])


def test_config_to_dict_covers_every_field() -> None:
    d = config_to_dict(TrainConfig())
    assert list(d) == list(section_types())
    for section, cls in section_types().items():
        assert set(d[section]) == {f.name for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------------- CLI, docs


def test_parse_cli_forms() -> None:
    path, overrides = parse_cli([
        "--config", "r.yaml", "--rollout.group_size=4", "--optim.lr", "3e-4",
        "trainer.steps=3", "--trainer.reference_model", "--optim.min_lr", "-1",
    ])
    assert path == "r.yaml"
    assert overrides == ["--rollout.group_size=4", "--optim.lr=3e-4", "trainer.steps=3",
                         "--trainer.reference_model=true", "--optim.min_lr=-1"]
    assert parse_cli(["--config=a.yaml"]) == ("a.yaml", [])
    assert parse_cli(["-c", "b.yaml"]) == ("b.yaml", [])
    assert "unrecognised argument" in error_of(parse_cli, ["stray"])
    # a field given without its section: the sections that have it
    assert error_of(parse_cli, ["--group_size=8"]).endswith(
        "did you mean --rollout.group_size=8?")
    assert error_of(parse_cli, ["--seed"]).endswith(
        "did you mean --data.seed or --trainer.seed or --evaluation.seed?")
    assert "needs a path" in error_of(parse_cli, ["--config"])


def test_config_from_argv(tmp_path: Path) -> None:
    cfg = config_from_argv(["--config", str(RECIPES / "tiny_grpo.yaml"),
                            "--rollout.group_size", "4", "--trainer.steps=2"], world_size=1)
    assert cfg.loss.variant == "grpo" and cfg.rollout.group_size == 4 and cfg.trainer.steps == 2
    with pytest.raises(ConfigError, match="rollout.group_size: must be >= 2"):
        config_from_argv(["--rollout.group_size=1"], world_size=1)
    with pytest.raises(ConfigError, match="trainer.num_minibatches"):
        config_from_argv(["--trainer.num_minibatches=3"], world_size=1)


def test_help_lists_every_field_with_docs(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for section, cls in section_types().items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name}  (" in text
    assert "G: responses per prompt" in text
    assert f"--loss.variant  (one of {', '.join(map(repr, LOSSES))}; default gspo)" in text
    # The production defaults, not the demo's.
    for line in ("--loss.clip_low  (float or null; default null)",
                 "--optim.lr  (float; default 1.0e-06)",
                 "--optim.lr_decay_style  (one of 'constant', 'linear', 'cosine'; default constant)",
                 "--sft.steps  (int; default 0)",
                 "--rollout.max_new_tokens  (int; default 1024)",
                 "--logging.run_dir  (str; default runs/gspo)"):
        assert line in text
    assert "paper default" in text and "recipes/demo.yaml" in text
    assert describe_config(["rollout"]).startswith("rollout:")


def test_field_docs_cover_every_field() -> None:
    for section, cls in section_types().items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{section}: fields without a docstring: {missing}"


def test_export_hf_needs_a_converted_init_and_a_free_destination(tmp_path) -> None:
    """checkpoint.export_hf is refused before anything runs when the HF config is unknown (no
    converted init_weights) or the destination is in use."""
    err = pytest.raises(ConfigError, validate_config,
                        demo(f"--checkpoint.export_hf={tmp_path / 'out'}"), 1).value
    assert "checkpoint.export_hf needs checkpoint.init_weights" in str(err) and len(err.errors) == 1
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    err = pytest.raises(ConfigError, validate_config,
                        demo(f"--checkpoint.export_hf={used}"), 1).value
    assert f"checkpoint.export_hf: '{used}' exists and is not an empty directory" in str(err)


def test_offload_needs_the_rollout_on_the_training_ranks():
    """trainer.offload makes room for this rank's rollout: refused, by name, when the training
    ranks never roll out (rollout.placement: separate); an unknown setting is refused too."""
    import os

    from gspo_megatron.config import ConfigError, load_config
    from gspo_megatron.config.validation import validate_config

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "configs", "tiny_gspo.yaml")
    ok = load_config(tiny, ["--trainer.offload=optimizer+grads"])
    assert validate_config(ok, 1, check_paths=False) == 1
    cfg = load_config(tiny, ["--trainer.offload=optimizer", "--rollout.placement=separate",
                             "--rollout.ranks=1"])
    with pytest.raises(ConfigError, match="trainer.offload='optimizer' with "
                                          "rollout.placement='separate'"):
        validate_config(cfg, 2, check_paths=False)
    with pytest.raises(ConfigError, match="trainer.offload"):
        load_config(tiny, ["--trainer.offload=weights"])
