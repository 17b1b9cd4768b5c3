"""``gspo-train``'s flags: ``--check`` (every problem of a recipe on one line each, a verdict,
exit 0 / 2, nothing written), ``--help SECTION``, ``--version``; and the rotary tables an
inference-mode pass leaves behind (full recompute saves them for backward)."""

import os
from pathlib import Path

import pytest

from gspo_megatron.cli import main
from gspo_megatron.config.command_line import parse_command_line
from gspo_megatron.config.validation import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "configs"
QWEN3_RECIPES = sorted(p.name for p in RECIPES.glob("qwen3_*.yaml"))


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        parse_command_line(["--config", "r.yaml", "--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("gspo-train 0.1.0 (megatron-core ")
    assert f"megatron-core {metadata.version('megatron-core')}, torch " in out


def test_help_one_section(capsys):
    with pytest.raises(SystemExit) as info:
        parse_command_line(["--help", "loss"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("loss:") and "--loss.variant  (" in text
    assert "--rollout." not in text and "usage:" not in text
    with pytest.raises(ConfigError, match=r"--help lose: unknown section; did you mean 'loss'"):
        parse_command_line(["--help", "lose"])
    with pytest.raises(SystemExit):  # a flag after --help is no section: the whole text
        parse_command_line(["--help", "--verbose"])
    assert "usage: gspo-train" in capsys.readouterr().out


def test_check_flags():
    args = parse_command_line(["--check", "--gpus", "16", "-c", "r.yaml", "--trainer.steps=3"])
    assert (args.check, args.gpus, args.config, args.overrides) == (True, 16, "r.yaml",
                                                                   ["--trainer.steps=3"])
    assert parse_command_line(["--check", "--gpus=8"]).gpus == 8
    with pytest.raises(ConfigError, match="--gpus needs a positive number of GPUs, got '0'"):
        parse_command_line(["--check", "--gpus", "0"])
    with pytest.raises(ConfigError, match="--gpus is for --check"):
        parse_command_line(["--gpus", "8"])


def test_check_tiny_recipe_ok(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["--check", "--config", str(RECIPES / "tiny_gspo.yaml"), f"--logging.run_dir={run}"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    assert lines[-1] == f"gspo-train --check: ok ({RECIPES / 'tiny_gspo.yaml'})"
    assert "check: data: 500 training, 120 held-out prompts" in lines
    assert any(line.startswith("check: memory plan: TP1 PP1 EP1 ETP1 CP1 on 1 GPUs")
               for line in lines)
    assert out.err == "" and not run.exists()


@pytest.mark.parametrize("recipe", QWEN3_RECIPES)
def test_check_shipped_recipe_names_each_missing_path(recipe, tmp_path, capsys, monkeypatch):
    """Each shipped cluster recipe as shipped, on a machine without its files: the training data,
    the converted checkpoint and the tokenizer (no Hub access here) each get one line; nothing is
    written (the run and checkpoint directories do not appear)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at its import: when an earlier test of this
    # process imported it, only its constant says offline (else each check waits on the network:
    # 47 s per recipe measured in the whole suite on a slow 2-core machine, 0.06 s alone)
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert len(QWEN3_RECIPES) == 4
    rc = main(["--check", "--config", str(RECIPES / recipe)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2
    text = (RECIPES / recipe).read_text()
    init = text.split("init_weights: ")[1].split()[0]
    tokenizer = text.split("tokenizer:")[1].split("path: ")[1].split()[0]
    missing = ["gspo-train: error: data.train_path: no such file '/data/math/train.parquet'",
               f"gspo-train: error: checkpoint.init_weights: no such path '{init}'",
               f"gspo-train: error: tokenizer.path={tokenizer!r} (tokenizer.kind="]
    for line in missing:
        assert sum(e.startswith(line) for e in err) == 1, (line, err)
    assert err[-1].startswith("gspo-train --check: ") and "problem(s) in" in err[-1]
    assert os.listdir(tmp_path) == []


def test_check_reports_every_problem_not_the_first(tmp_path, capsys):
    """A layout that does not divide, a missing file and a reward that does not import: three
    lines (prepare() would stop at the first)."""
    rc = main(["--check", "--config", str(RECIPES / "tiny_gspo.yaml"),
               "--parallel.expert_model_parallel_size=3", "--data.source=file",
               f"--data.train_path={tmp_path / 'none.jsonl'}", "--reward.fn=no_pkg.mod:fn",
               f"--logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "expert_model_parallel_size" in err and "none.jsonl" in err and "no_pkg.mod:fn" in err
    assert "gspo-train --check: 3 problem(s)" in err
    assert not (tmp_path / "run").exists()


def test_rotary_tables_made_in_inference_mode_are_dropped():
    """Megatron's rotary table is cached per length; one made in inference mode (a rollout, the
    old-log-prob pass) must not reach the update, where full recompute saves it for backward."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from gspo_megatron.backends.megatron.parallel import drop_inference_buffers
    from gspo_megatron.compat import apply_compat

    apply_compat()  # Megatron's rotary table on the CPU (it asks for the current CUDA device)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    with torch.inference_mode():
        assert rope(16).is_inference()
    assert rope(16).is_inference()  # the cache hands the inference tensor to a training pass
    drop_inference_buffers()
    table = rope(16)
    assert not table.is_inference()
    with torch.inference_mode():
        again = rope(16)
    assert again is table and torch.equal(again, table)  # remade, the same values


def test_wandb_online_when_logged_in(tmp_path):
    """``wandb login`` writes a netrc entry for the wandb host: online, saying so; without one
    (and no key, no settings) offline; WANDB_MODE, when the user set it, wins."""
    from types import SimpleNamespace

    from gspo_megatron.metrics import wandb_mode

    no_key = SimpleNamespace(api=SimpleNamespace(api_key=None))
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    assert wandb_mode({"NETRC": str(netrc)}, no_key) == ("online", f"logged in: {netrc}")
    mode, why = wandb_mode({"NETRC": str(tmp_path / "none")}, no_key)
    assert mode == "offline" and "wandb sync" in why
    # A netrc for another host (a W&B server elsewhere) does not count for api.wandb.ai ...
    assert wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"},
                      no_key)[0] == "offline"
    # ... and wandb's own settings, the environment key and the user's mode do.
    keyed = SimpleNamespace(api=SimpleNamespace(api_key="k"))
    assert wandb_mode({"NETRC": str(tmp_path / "none")}, keyed) == ("online",
                                                                   "logged in: wandb settings")
    assert wandb_mode({"WANDB_API_KEY": "k"}, no_key) == ("online", "logged in: WANDB_API_KEY")
    assert wandb_mode({"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, keyed) == ("offline",
                                                                                 "WANDB_MODE")


def test_tensorboard_dir_that_is_a_file(tmp_path, capsys):
    """One line naming the field, exit 2, before the run directory exists."""
    afile = tmp_path / "tb"
    afile.write_text("")
    run = tmp_path / "run"
    rc = main(["--config", str(RECIPES / "tiny_gspo.yaml"), f"--logging.run_dir={run}",
               f"--logging.tensorboard_dir={afile}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (f"gspo-train: error: logging.tensorboard_dir: {afile} exists and is "
                           "not a directory")
    assert not run.exists()
