"""The mutation-check tool itself (tools/mutate.py): its mutants still match the source, and
planting one never touches the working tree. Fast: no mutant's tests are run here."""

from pathlib import Path

import pytest

from tools import mutate

ROOT = Path(__file__).resolve().parents[2]


def test_every_snippet_occurs_exactly_once_and_the_mutant_compiles():
    assert mutate.check_snippets(mutate.MUTANTS) == []
    assert len({m.name for m in mutate.MUTANTS}) == len(mutate.MUTANTS)
    for m in mutate.MUTANTS:
        assert m.find != m.replace, m.name
        compile(mutate.mutate_text((ROOT / m.file).read_text(), m), m.file, "exec")
        for arg in m.tests:  # every selected test file exists
            if arg.startswith("tests/"):
                assert (ROOT / arg.split("::")[0]).is_file(), (m.name, arg)


def test_missing_or_ambiguous_snippet_is_an_error():
    m = mutate.Mutant("x", "f.py", "a = 1", "a = 2", ())
    assert mutate.mutate_text("b = 0\na = 1\n", m) == "b = 0\na = 2\n"
    with pytest.raises(mutate.MutantError, match="occurs 0 times"):
        mutate.mutate_text("b = 0\n", m)
    with pytest.raises(mutate.MutantError, match="occurs 2 times"):
        mutate.mutate_text("a = 1\na = 1\n", m)
    assert "not found" in mutate.check_snippets((m,), root=ROOT)[0]


def test_mutating_the_copy_leaves_the_working_tree_untouched(tmp_path):
    m = mutate.MUTANTS[0]
    before = (ROOT / m.file).read_bytes()
    copy = mutate.make_copy(tmp_path / "copy")
    target = copy / m.file
    target.write_text(mutate.mutate_text(target.read_text(), m))
    assert m.replace in target.read_text()
    assert (ROOT / m.file).read_bytes() == before
    assert not list(copy.rglob("__pycache__"))
    mutate.check_import_path(copy)  # the copy imports its own gspo_megatron


def test_status_and_table():
    assert mutate.status_of(1, ["tests/unit/t.py::a"]) == "caught"
    assert mutate.status_of(0, []) == "NOT caught"
    assert mutate.status_of(2, []) == "ERROR (exit 2)"  # collection error is not a catch
    assert mutate.status_of(124, []) == "ERROR (timeout)"
    row = {"name": "|y_i| bug", "file": "f.py", "status": "caught", "failing_tests": ["t::a"]}
    line = mutate.table([row]).splitlines()[-1]
    assert line == "| 1 | \\|y_i\\| bug | `f.py` | caught | `t::a` |"
