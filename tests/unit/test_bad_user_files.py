"""Bad files a user hands ``gspo-train`` (issue 13): reward modules, tokenizers, data files.

Each is refused before any compute: exit code 2, one line naming the file (and line), no
traceback, no run directory. The CLI runs from a scratch working directory, as a user would run it
next to their recipe, so a reward module there is found without ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gspo_megatron.backends.megatron import plain_state
from gspo_megatron.data import DatasetError, load_prompt_dataset
from gspo_megatron.rewards import get_reward_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHEAP = ["--data.num_train_examples=50", "--data.num_eval_examples=10"]


def run_cli(cwd, *args, cold=False, **env_extra):
    """``python -m gspo_megatron.cli`` in ``cwd``: forked from the suite's warm interpreter
    (tests/helpers/warm.py: the same exit code, output and files, without ~3 s of imports per
    case), or with ``cold`` a fresh interpreter (its start-up warnings included; the one-line
    refusals of a fresh start are tests/unit/test_bad_inputs.py's)."""
    from tests.helpers import warm

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_extra)
    run_dir = cwd / "run"
    argv = ["-m", "gspo_megatron.cli", f"--logging.run_dir={run_dir}", *CHEAP, *args]
    if cold:
        proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=120)
    else:
        proc = warm.run(argv, env=env, cwd=str(cwd), timeout=120)
    return proc, run_dir


def assert_refused(proc, run_dir, *needles, before=None):
    """Exit 2, one line naming ``needles``, no traceback, and nothing written: no ``run_dir``, or
    (``before``, a :func:`snapshot` of a tree that existed already) that tree unchanged."""
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gspo-train: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if before is None:
        assert not run_dir.exists()
    else:
        assert snapshot(before[0]) == before, "the refused run wrote files"


def snapshot(root):
    """``(root, {relative path: size})`` of every file and directory under ``root``."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, root)] = os.path.getsize(path)
    return root, files


@pytest.mark.parametrize("source, needles", [
    ("def reward(response, answer, example=None)\n    return 1.0\n",
     ["my_reward_syntax.py:1", "syntax error", "my_reward_syntax"]),
    ("raise RuntimeError('no API key')\n", ["my_reward_raises", "RuntimeError: no API key"]),
    ("import no_such_package_xyz\n", ["my_reward_missing", "no_such_package_xyz"]),
])
def test_reward_module_that_cannot_be_imported(tmp_path, source, needles):
    name = needles[0].split(".")[0].split(":")[0]
    (tmp_path / f"{name}.py").write_text(source)
    proc, run_dir = run_cli(tmp_path, f"--reward.fn={name}:reward")
    assert_refused(proc, run_dir, *needles)


def test_reward_module_next_to_the_recipe_is_found_without_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "local_reward_ok.py").write_text(
        "def reward(response, answer, example=None):\n    return float(response == answer)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = get_reward_fn("local_reward_ok:reward")
    assert fn("2", "2") == 1.0
    assert str(tmp_path) not in sys.path  # the working directory was searched, not left behind


def test_reward_module_next_to_the_recipe_found_from_another_directory(tmp_path):
    """``gspo-train --config recipes/r.yaml`` run from elsewhere finds ``recipes/my_reward.py``
    (the recipe's directory is searched after sys.path and the working directory)."""
    recipes, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    recipes.mkdir(), elsewhere.mkdir()
    (recipes / "near_recipe_reward.py").write_text(
        "def reward(response, answer, example=None):\n    return float(response == answer)\n")
    (recipes / "r.yaml").write_text("reward: {fn: 'near_recipe_reward:reward'}\n"
                                    "model: {seq_length: 2048}\n")
    # a bad override stops the run after the reward resolved (prepare checks the reward first)
    proc, run_dir = run_cli(elsewhere, "--config", str(recipes / "r.yaml"),
                            "--data.num_train_examples=3")
    assert_refused(proc, run_dir, "data.num_train_examples: 3 prompts")
    proc, run_dir = run_cli(elsewhere, "--config", str(recipes / "r.yaml"),
                            "--reward.fn=not_near_any_reward:reward", "--data.num_train_examples=3")
    assert_refused(proc, run_dir, "cannot import module 'not_near_any_reward'")


def test_hf_tokenizer_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no" / "such" / "tokenizer"
    proc, run_dir = run_cli(tmp_path, "--tokenizer.kind=hf", f"--tokenizer.path={missing}")
    assert_refused(proc, run_dir, f"tokenizer.path='{missing}' (tokenizer.kind='hf'): "
                   f"tokenizer directory not found: {missing}")


def test_hf_tokenizer_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "empty_tok").mkdir()
    proc, run_dir = run_cli(tmp_path, "--tokenizer.kind=hf", f"--tokenizer.path={tmp_path / 'empty_tok'}")
    assert_refused(proc, run_dir, "empty_tok", "(directory): cannot load a Hugging Face tokenizer")


def test_file_that_is_not_a_sentencepiece_model(tmp_path):
    bogus = tmp_path / "tok.model"
    bogus.write_bytes(b"this is not a protobuf \x00\x01\x02")
    proc, run_dir = run_cli(tmp_path, "--tokenizer.kind=sentencepiece", f"--tokenizer.path={bogus}")
    assert_refused(proc, run_dir, f"{bogus}: not a SentencePiece model")


def test_non_utf8_bytes_in_a_jsonl_file_name_the_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "4"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:2: not UTF-8 \(byte 0xe9"):
        load_prompt_dataset(path)
    json_path = tmp_path / "train.json"
    json_path.write_bytes(b'[\n{"prompt": "1+1=", "answer": "2"},\n{"prompt": "\xff", "answer": "1"}]\n')
    with pytest.raises(DatasetError, match=rf"{json_path}:3: not UTF-8"):
        load_prompt_dataset(json_path)
    proc, run_dir = run_cli(tmp_path, "--data.source=file", f"--data.train_path={path}")
    assert_refused(proc, run_dir, f"{path}:2: not UTF-8")


def test_directory_given_as_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match="is a directory; give a dataset file"):
        load_prompt_dataset(tmp_path)
    proc, run_dir = run_cli(tmp_path, "--data.source=file", f"--data.train_path={tmp_path}")
    assert_refused(proc, run_dir, f"{tmp_path}: is a directory")


# ------------------------------------------------------------------ data too small for one step


def test_fewer_generated_prompts_than_one_step_needs(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--data.num_train_examples=10")  # demo: 16 prompts a step
    assert_refused(proc, run_dir, "data.num_train_examples: 10 prompts, fewer than one RL step "
                   "needs (rollout.prompts_per_step x data-parallel size = 16 x 1 = 16)")


def test_fewer_file_prompts_than_one_step_needs_on_every_data_parallel_rank(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(10)))
    data = ["--data.source=file", f"--data.train_path={path}"]
    proc, run_dir = run_cli(tmp_path, *data, "--rollout.prompts_per_step=8", WORLD_SIZE="2")
    assert_refused(proc, run_dir, f"data.train_path: {path} has 10 prompts, fewer than one RL "
                   "step needs (rollout.prompts_per_step x data-parallel size = 8 x 2 = 16)")


def test_held_out_set_smaller_than_the_data_parallel_size(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--data.num_eval_examples=1", "--rollout.prompts_per_step=8",
                            WORLD_SIZE="2")
    assert_refused(proc, run_dir, "data.num_eval_examples: 1 held-out prompts, fewer than the "
                   "data-parallel size 2")


def test_more_generated_problems_than_the_task_has(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--data.num_eval_examples=1000")
    assert_refused(proc, run_dir, "data.num_eval_examples=1000: ", "has only 128",
                   "lower data.num_eval_examples or raise data.max_operand")


# ------------------------------------------------------------------ prompts too long: 1-based


def test_prompt_too_long_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = ['{"prompt": "1+1=", "answer": "2"}', "", '{"prompt": "12+13+14+15=", "answer": "54"}']
    path.write_text("\n".join(rows * 20) + "\n")
    proc, run_dir = run_cli(tmp_path, "--data.source=file", f"--data.train_path={path}",
                            "--data.max_prompt_length=5")
    assert_refused(proc, run_dir, f"{path}:3: prompt has ", "more than data.max_prompt_length=5")


def test_generated_prompt_too_long_is_numbered_from_one(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--data.max_prompt_length=3")
    assert_refused(proc, run_dir, "data.source=arithmetic: train example 1 (",
                   "more than data.max_prompt_length=3")


# ------------------------------------------------------------------ directories the run writes


def test_run_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc, run_dir = run_cli(tmp_path, f"--logging.run_dir={tmp_path / 'afile'}")
    assert_refused(proc, run_dir, f"logging.run_dir: {tmp_path / 'afile'} exists and is not a "
                   "directory", before=snapshot(tmp_path))


def test_run_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc, run_dir = run_cli(tmp_path, f"--logging.run_dir={tmp_path / 'afile' / 'run'}")
    assert_refused(proc, run_dir, f"logging.run_dir: cannot create {tmp_path / 'afile' / 'run'}: "
                   f"{tmp_path / 'afile'} is a file, not a directory")


def test_save_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.save_dir={tmp_path / 'afile' / 'ckpt'}")
    assert_refused(proc, run_dir, "checkpoint.save_dir: cannot create", "is a file")


# ------------------------------------------------------------------ checkpoints the run reads


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step demo run: its ``sft_weights`` and ``checkpoints`` (iteration 1)."""
    cwd = tmp_path_factory.mktemp("trained")
    proc, run_dir = run_cli(cwd, "--trainer.steps=1", "--sft.steps=1", "--logging.progress=false")
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.mark.parametrize("kind", ["empty directory", "plain file", "missing path"])
def test_init_weights_that_is_not_a_checkpoint(tmp_path, kind):
    target = tmp_path / "weights"
    if kind == "empty directory":
        target.mkdir()
        needle = f"checkpoint.init_weights: not a checkpoint directory: {target}"
    elif kind == "plain file":
        target.write_text("not weights")
        needle = f"checkpoint.init_weights: not a directory: {target}"
    else:
        needle = f"checkpoint.init_weights: no such path '{target}'"
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.init_weights={target}")
    assert_refused(proc, run_dir, needle)


@pytest.mark.parametrize("weights, override, needle", [
    ("sft_weights", "--model.hidden_size=32",
     "model tensor embedding.word_embeddings.weight has shape [128, 64] in the checkpoint, the "
     "config's model gives [128, 32] (model.vocab_size padded to 128, model.hidden_size)"),
    ("checkpoints", "--model.num_layers=3",
     "model tensor decoder.layers.self_attention.linear_qkv.weight has shape [2, 128, 64] in the "
     "checkpoint, the config's model gives [3, 128, 64] (model.num_layers"),
])
def test_init_weights_with_other_shapes(trained, tmp_path, weights, override, needle):
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.init_weights={trained / weights}", override)
    assert_refused(proc, run_dir, f"checkpoint.init_weights: {trained / weights}", needle)


def test_resume_with_other_shapes(trained, tmp_path):
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.load_dir={trained / 'checkpoints'}",
                            "--model.num_layers=3")
    assert_refused(proc, run_dir, "cannot resume (checkpoint.load_dir): "
                   f"{trained / 'checkpoints' / 'iter_0000001'}: model tensor")


def test_resume_with_another_lr_schedule(trained, tmp_path):
    """A resume whose LR schedule is not the checkpoint's is refused, naming the field (megatron-core
    would keep the checkpoint's: a run extended from 1 to 10 steps decayed to min_lr at the old
    end and trained at the floor); ``optim.override_opt_param_scheduler`` follows the new one."""
    load = f"--checkpoint.load_dir={trained / 'checkpoints'}"
    proc, run_dir = run_cli(tmp_path, load, "--trainer.steps=10")
    assert_refused(proc, run_dir, "cannot resume (checkpoint.load_dir): ",
                   "the LR schedule differs from the checkpoint's: lr_decay_steps 40 from "
                   "optim.lr_decay_steps (null: trainer.steps 10 x trainer.num_minibatches 4), "
                   "21 in the checkpoint", "optim.override_opt_param_scheduler=true")
    proc, run_dir = run_cli(tmp_path, load, "--optim.lr=1e-4")
    assert_refused(proc, run_dir, "max_lr 0.0001 from optim.lr, 0.0003 in the checkpoint")
    (tmp_path / "same").mkdir(), (tmp_path / "override").mkdir()
    proc, _ = run_cli(tmp_path / "same", load, "--trainer.steps=2",  # decay spans 21 steps either way
                      "--logging.progress=false")
    assert proc.returncode == 0, proc.stderr
    proc, run_dir = run_cli(tmp_path / "override", load, "--trainer.steps=10",
                            "--optim.override_opt_param_scheduler=true", "--logging.progress=false")
    assert proc.returncode == 0, proc.stderr
    lrs = [json.loads(line)["optim/lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Warm-up to optimiser step 20, then the decay over 40 (the checkpoint's schedule would have
    # reached min_lr 3e-5 at step 21 and stayed there).
    assert len(lrs) == 9 and max(lrs) == 3e-4 and lrs[-1] < lrs[4] and lrs[4] > 2e-4


@pytest.mark.parametrize("content, needle", [
    ("garbage\n", "expected an iteration number, found 'garbage'"),
    ("\xff\xfe", "expected an iteration number"),
    ("7\n", "names iteration 7, but {ckpts}/iter_0000007 is missing or not a checkpoint and no "
             "older checkpoint is there to resume from"),
])
def test_corrupt_or_dangling_tracker_refused_before_anything_is_written(tmp_path, content, needle):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "latest_checkpointed_iteration.txt").write_text(content, encoding="latin-1")
    before = snapshot(tmp_path / "run")
    proc, run_dir = run_cli(tmp_path)
    assert_refused(proc, run_dir, "cannot resume (logging.run_dir): "
                   f"{ckpts / 'latest_checkpointed_iteration.txt'}: ",
                   needle.format(ckpts=ckpts), before=before)


def test_dangling_tracker_in_load_dir(tmp_path):
    ckpts = tmp_path / "elsewhere"
    ckpts.mkdir()
    (ckpts / "latest_checkpointed_iteration.txt").write_text("3")
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.load_dir={ckpts}")
    assert_refused(proc, run_dir, "cannot resume (checkpoint.load_dir): ", "names iteration 3")


def test_megatron_warnings_only_with_verbose(trained, tmp_path):
    """A refusal found after Megatron is imported (tensor metadata) is still one line; --verbose
    shows the start-up warnings it hides."""
    args = [f"--checkpoint.init_weights={trained / 'sft_weights'}", "--model.hidden_size=32"]
    quiet, run_dir = run_cli(tmp_path, *args, cold=True)
    assert_refused(quiet, run_dir, "model tensor embedding.word_embeddings.weight")
    loud, run_dir = run_cli(tmp_path, "--verbose", *args, cold=True)
    assert loud.returncode == 2 and not run_dir.exists()
    assert "Warning" in loud.stderr and "Traceback" not in loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip()


@pytest.mark.parametrize("rank_state, args, needle", [
    # separate placement, max_staleness 1: the samples of step 2 already rolled out
    ({"placement": "separate", "received": {2: {"step": 2}}, "sampler": None, "partial": None},
     [], "rollout.placement: the checkpoint was written by a separate placement with the samples "
         "of 1 step(s) already rolled out (steps 2..2), which a colocated run cannot train on"),
    # a checkpoint of before the placement was recorded (the trainer's end kept "received")
    ({"received": {2: {"step": 2}, 3: {"step": 3}}, "sampler": None, "partial": None},
     [], "samples of 2 step(s) already rolled out (steps 2..3)"),
    ({"placement": "colocated", "partial": {"groups": [{"prompt": None}] * 3}},
     ["--rollout.partial_rollouts=false"],
     "rollout.partial_rollouts: the checkpoint (colocated placement) holds 3 group(s) of partial "
     "rollouts in flight"),
])
def test_a_resume_that_would_lose_what_is_in_flight_is_refused(tmp_path, rank_state, args, needle):
    """A checkpoint whose rollouts in flight the new run cannot take over: refused in one line
    before anything is written (on c24cbcc the separate -> colocated resume drew those steps'
    prompts again and lost the samples; partial groups were dropped without a word)."""
    import torch

    ckpts = tmp_path / "run" / "checkpoints"
    it = ckpts / "iter_0000002"
    (it / "rank").mkdir(parents=True)
    (it / "metadata.json").write_text("{}")
    torch.save({"format": plain_state.FORMAT, "state": plain_state.encode(rank_state)},
               it / "rank" / "rank_00000.pt")
    (ckpts / "latest_checkpointed_iteration.txt").write_text("2")
    before = snapshot(tmp_path / "run")
    proc, run_dir = run_cli(tmp_path, *args)
    assert_refused(proc, run_dir, f"cannot resume (logging.run_dir): {it}: ", needle, before=before)


class _WritesAFile:
    """Unpickled, it opens (creates) ``path``: what a planted checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """A rank state holding a pickle that writes a file when loaded, at --checkpoint.load_dir:
    refused in one line naming checkpoint.allow_pickle; the file is never written, nor the run."""
    import torch

    planted = tmp_path / "elsewhere"
    it = planted / "iter_0000002"
    (it / "rank").mkdir(parents=True)
    (it / "metadata.json").write_text("{}")
    marker = tmp_path / "pwned"
    torch.save({"placement": "colocated", "partial": _WritesAFile(str(marker))},
               it / "rank" / "rank_00000.pt")
    (planted / "latest_checkpointed_iteration.txt").write_text("2")
    before = snapshot(planted)
    proc, run_dir = run_cli(tmp_path, f"--checkpoint.load_dir={planted}")
    assert_refused(proc, run_dir, f"cannot resume (checkpoint.load_dir): {it}: ",
                   "rank_00000.pt: holds pickled Python objects", "checkpoint.allow_pickle: true")
    assert snapshot(planted) == before and not marker.exists()
