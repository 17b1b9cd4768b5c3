"""Prompt dataset loading/validation, the sampler's determinism and resume, the arithmetic task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gspo_megatron.data import (
    DatasetError,
    PromptExample,
    PromptSampler,
    arithmetic_split_of,
    arithmetic_tokenizer_corpus,
    get_dotted,
    load_prompt_dataset,
    make_arithmetic_dataset,
    make_arithmetic_splits,
)


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Reason step by step."},
            {"role": "user", "content": "What is 40+2?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"index": 7, "split": "train"},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Half of one?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"index": 8, "split": "train"},
    },
]


# ----------------------------------------------------------------------------------- loading


def test_slime_jsonl_with_custom_keys(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": 4}])
    exs = load_prompt_dataset(p, answer_key="label")
    assert [e.prompt for e in exs] == ["1+1=", "2+2="]
    assert [e.answer for e in exs] == ["2", "4"]  # numeric answers become strings
    assert [e.index for e in exs] == [0, 1]
    assert exs[0].messages is None and exs[0].model_input == "1+1="
    assert exs[0].metadata == {"label": "2"}


def test_blank_lines_skipped_and_line_numbers_count_them(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p)
    assert f"{p}:3" in str(ei.value) and "'answer'" in str(ei.value)


def test_verl_layout_jsonl_nested_answer_and_messages(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "verl.jsonl", VERL_ROWS)
    exs = load_prompt_dataset(p, answer_key="reward_model.ground_truth", id_key="extra_info.index")
    assert [e.answer for e in exs] == ["42", "\\frac{1}{2}"]
    assert exs[0].messages == VERL_ROWS[0]["prompt"]
    assert exs[0].model_input == VERL_ROWS[0]["prompt"]
    assert exs[0].prompt == "What is 40+2?"  # last user message, for logging/rewards
    assert exs[0].uid == "7"
    assert exs[0].metadata["data_source"] == "openai/gsm8k"
    assert "prompt" not in exs[0].metadata


def test_verl_layout_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), p)
    exs = load_prompt_dataset(p, answer_key="reward_model.ground_truth")
    assert len(exs) == 2
    assert exs[1].answer == "\\frac{1}{2}"
    assert exs[1].messages == [{"role": "user", "content": "Half of one?"}]
    assert exs[0].metadata["extra_info"] == {"index": 7, "split": "train"}


def test_parquet_missing_field_names_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "x", "answer": "1"}] * 2), p)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1: missing prompt field 'prompt'"):
        load_prompt_dataset(p)


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p)
    assert f"{p}:2" in str(ei.value) and "invalid JSON" in str(ei.value)


def test_missing_answer_names_field_and_line(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p, answer_key="label")
    msg = str(ei.value)
    assert f"{p}:2" in msg and "'label'" in msg


def test_missing_nested_answer(tmp_path: Path) -> None:
    rows = [dict(VERL_ROWS[0], reward_model={"style": "rule"})]
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=r":1: missing answer field 'reward_model.ground_truth'"):
        load_prompt_dataset(p, answer_key="reward_model.ground_truth")


def test_missing_fields_name_the_recipe_key_and_the_layout_found(tmp_path: Path) -> None:
    """The error says which recipe field to set and, when the row is in a peer's layout, to what."""
    p = _write_jsonl(tmp_path / "verl.jsonl", VERL_ROWS)
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p, answer_key="answer")
    assert str(ei.value).startswith(f"{p}:1: missing answer field 'answer' (row has keys [")
    assert str(ei.value).endswith("]); set data.answer_key to the field that holds the answer; "
                                  "this row has 'reward_model.ground_truth' (verl's layout)")
    p = _write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "result": "2"}])
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p, answer_key="result")
    assert "set data.prompt_key to the field that holds the prompt; this row has 'question'" in \
        str(ei.value)
    p = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1=", "result": "2"}])
    with pytest.raises(DatasetError) as ei:
        load_prompt_dataset(p, answer_key="answer")
    assert str(ei.value).endswith("set data.answer_key to the field that holds the answer "
                                  "(reward_model.ground_truth (verl's layout), label (slime's "
                                  "layout))")


@pytest.mark.parametrize(
    "prompt",
    ["", "   ", [], [{"role": "user", "content": " "}]],
    ids=["empty-str", "blank-str", "no-messages", "blank-message"],
)
def test_empty_prompt_rejected(tmp_path: Path, prompt: object) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: empty prompt"):
        load_prompt_dataset(p)


def test_malformed_message_and_wrong_type(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"content": "no role"}], "answer": "1"}])
    with pytest.raises(DatasetError, match=r":1: .*'role' and 'content'"):
        load_prompt_dataset(p)
    p = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(DatasetError, match=r":1: .*string or a list of chat messages"):
        load_prompt_dataset(p)
    p = _write_jsonl(tmp_path / "f.jsonl", [[1, 2]])
    with pytest.raises(DatasetError, match=r"f\.jsonl:1: expected a JSON object"):
        load_prompt_dataset(p)


def test_empty_answer_and_empty_file(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": ""}])
    with pytest.raises(DatasetError, match=r":1: empty answer"):
        load_prompt_dataset(p)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="no examples"):
        load_prompt_dataset(empty)


def test_no_answer_key_missing_file_and_format(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    assert load_prompt_dataset(p, answer_key=None)[0].answer == ""
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported"):
        load_prompt_dataset(csv)


def test_json_array_multiple_files_and_max_examples(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}]))
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p3", "answer": "3"}])
    exs = load_prompt_dataset([a, b])
    assert [e.prompt for e in exs] == ["p1", "p2", "p3"] and [e.index for e in exs] == [0, 1, 2]
    assert len(load_prompt_dataset([a, b], max_examples=2)) == 2


def test_get_dotted() -> None:
    row = {"a": {"b": {"c": 1}}, "x.y": 2}
    assert get_dotted(row, "a.b.c") == 1
    assert get_dotted(row, "x.y") == 2
    assert get_dotted(row, "a.q", None) is None
    with pytest.raises(KeyError):
        get_dotted(row, "a.q")


# ----------------------------------------------------------------------------------- sampler


def _examples(n: int) -> list[PromptExample]:
    return [PromptExample(prompt=f"p{i}", answer=str(i), index=i) for i in range(n)]


def _uids(batch: list[PromptExample]) -> list[str]:
    return [e.uid for e in batch]


def test_sampler_deterministic_and_epoch_coverage() -> None:
    exs = _examples(12)
    a, b = PromptSampler(exs, 4, seed=3), PromptSampler(exs, 4, seed=3)
    batches_a = [_uids(a.next_batch()) for _ in range(9)]
    assert batches_a == [_uids(b.next_batch()) for _ in range(9)]
    epoch0 = sorted(sum(batches_a[:3], []), key=int)
    assert epoch0 == [str(i) for i in range(12)]  # each epoch is a permutation
    assert sum(batches_a[:3], []) != sum(batches_a[3:6], [])  # reshuffled per epoch
    other = PromptSampler(exs, 4, seed=4)
    assert [_uids(other.next_batch()) for _ in range(3)] != batches_a[:3]
    assert a.epoch == 2 and a.position == 3


def test_sampler_resume_yields_same_batches() -> None:
    exs = _examples(10)  # 3 batches of 3 per epoch, remainder dropped
    ref = PromptSampler(exs, 3, seed=11)
    for _ in range(4):  # into epoch 1
        ref.next_batch()
    state = ref.state_dict()
    expected = [_uids(ref.next_batch()) for _ in range(7)]
    resumed = PromptSampler(exs, 3, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert [_uids(resumed.next_batch()) for _ in range(7)] == expected
    # Resuming exactly at an epoch boundary.
    ref2 = PromptSampler(exs, 3, seed=11)
    for _ in range(3):
        ref2.next_batch()
    s2 = ref2.state_dict()
    r2 = PromptSampler(exs, 3, seed=11)
    r2.load_state_dict(s2)
    assert _uids(r2.next_batch()) == _uids(ref2.next_batch())


def test_sampler_rejects_mismatched_state_and_small_dataset() -> None:
    s = PromptSampler(_examples(10), 3, seed=1)
    with pytest.raises(ValueError, match="dataset_size"):
        PromptSampler(_examples(11), 3, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(_examples(10), 3, seed=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="fewer than num_prompts"):
        PromptSampler(_examples(2), 3)
    unshuffled = PromptSampler(_examples(4), 2, shuffle=False)
    assert _uids(unshuffled.next_batch()) == ["0", "1"]


# ----------------------------------------------------------------------------------- arithmetic


def test_arithmetic_deterministic_and_correct() -> None:
    a = make_arithmetic_dataset(200, seed=5)
    b = make_arithmetic_dataset(200, seed=5)
    assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]
    assert [e.prompt for e in make_arithmetic_dataset(200, seed=6)] != [e.prompt for e in a]
    assert len({e.prompt for e in a}) == 200  # unique by default
    for e in a:
        x, op, y = e.metadata["a"], e.metadata["op"], e.metadata["b"]
        assert e.prompt == f"{x}{op}{y}="
        assert int(e.answer) == (x + y if op == "+" else x - y)
        assert int(e.answer) >= 0  # no negative results by default
        assert 0 <= x <= 20 and 0 <= y <= 20


def test_arithmetic_train_heldout_disjoint() -> None:
    train, held = make_arithmetic_splits(500, 50, seed=0)
    other_train = make_arithmetic_dataset(600, seed=123, split="train")
    held_prompts = {e.prompt for e in held}
    assert len(held_prompts) == 50
    assert not held_prompts & {e.prompt for e in train}
    assert not held_prompts & {e.prompt for e in other_train}  # whatever the seed
    assert all(arithmetic_split_of(p) == "heldout" for p in held_prompts)


def test_arithmetic_options_and_errors() -> None:
    exs = make_arithmetic_dataset(50, seed=1, min_operand=10, max_operand=99, ops=("+",))
    assert all("+" in e.prompt and "-" not in e.prompt for e in exs)
    neg = make_arithmetic_dataset(300, seed=1, ops=("-",), max_operand=30, allow_negative=True)
    assert any(e.answer.startswith("-") for e in neg)
    big = make_arithmetic_dataset(100, seed=1, max_operand=9999)  # rejection-sampled path
    assert len({e.prompt for e in big}) == 100
    with pytest.raises(ValueError, match="unique"):
        make_arithmetic_dataset(10_000, seed=0, max_operand=9)
    assert len(make_arithmetic_dataset(1000, seed=0, max_operand=9, unique=False)) == 1000
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_dataset(5, ops=("/",))
    corpus = arithmetic_tokenizer_corpus(exs[:3])
    assert corpus[0] == "0123456789+-*=" and corpus[1] == exs[0].prompt + exs[0].answer


def test_chain_answers_are_worked_step_by_step_and_right() -> None:
    """Every step of every chain is recomputed independently: the step's left value is the
    previous result, the operand and operator are the prompt's, the running value stays >= 0."""
    import re

    from gspo_megatron.data import make_chain_dataset

    examples = make_chain_dataset(400, seed=7, split="train", num_operands=6, max_operand=9)
    assert len({e.prompt for e in examples}) == 400
    for e in examples:
        tokens = re.findall(r"\d+|[+-]", e.prompt[:-1])
        operands, ops = [int(t) for t in tokens[0::2]], tokens[1::2]
        assert len(operands) == 6 and e.prompt.endswith("=")
        steps = e.answer.split(",")
        assert len(steps) == 5
        value = operands[0]
        for step, op, b in zip(steps, ops, operands[1:]):
            new = value + b if op == "+" else value - b
            assert step == f"{value}{op}{b}={new}" and new >= 0
            value = new
    mean_tokens = sum(len(e.answer) + 1 for e in examples) / len(examples)  # chars + EOS
    assert mean_tokens >= 32  # the routing study's "answers average >= 32 tokens"


def test_chain_splits_are_disjoint_and_seeded() -> None:
    from gspo_megatron.data import make_chain_dataset

    train = make_chain_dataset(300, seed=1, split="train", heldout_fraction=0.2)
    held = make_chain_dataset(60, seed=1, split="heldout", heldout_fraction=0.2)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert all(arithmetic_split_of(e.prompt, 0.2) == "heldout" for e in held)
    assert [e.prompt for e in make_chain_dataset(300, seed=1, split="train", heldout_fraction=0.2)] \
        == [e.prompt for e in train]
    assert [e.prompt for e in make_chain_dataset(300, seed=2, split="train", heldout_fraction=0.2)] \
        != [e.prompt for e in train]
    with pytest.raises(ValueError, match="num_operands"):
        make_chain_dataset(5, num_operands=1)
    with pytest.raises(ValueError, match="unique"):
        make_chain_dataset(200, num_operands=2, max_operand=3)  # only 4 x 4 x ~2 problems


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_prompt_dataset(p)
