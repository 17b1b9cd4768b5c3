"""Bad files a user hands ``gspo-train`` (issue 13): reward modules, tokenizers, data files.

Each is refused before any compute: exit code 2, one line naming the file (and line), no
traceback, no run directory. The CLI runs from a scratch working directory, as a user would run it
next to their recipe, so a reward module there is found without ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_megatron.data import DatasetError, load_prompt_dataset
from gspo_megatron.rewards import get_reward_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHEAP = ["--data.num_train_examples=50", "--data.num_eval_examples=10"]


def run_cli(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run_dir = cwd / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", f"--logging.run_dir={run_dir}",
                           *CHEAP, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, run_dir


def assert_refused(proc, run_dir, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gspo-train: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not run_dir.exists()


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


def test_hf_tokenizer_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no" / "such" / "tokenizer"
    proc, run_dir = run_cli(tmp_path, "--tokenizer.kind=hf", f"--tokenizer.path={missing}")
    assert_refused(proc, run_dir, f"tokenizer directory not found: {missing}")


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
