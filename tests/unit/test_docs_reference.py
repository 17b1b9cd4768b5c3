"""The generated references (docs/reference/) match the code they are generated from, and every
metric the package writes is documented in gspo_megatron/metric_docs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron import metric_docs
from gspo_megatron.tools import docs_ref

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(docs_ref.generated(), key=str), ids=str)
def test_committed_reference_matches_the_code(rel: Path) -> None:
    committed = (ROOT / rel).read_text(encoding="utf-8")
    assert committed == docs_ref.generated()[rel], (
        f"{rel} is stale: run `python -m gspo_megatron.tools.docs_ref` and commit the result")


def test_every_metric_in_the_source_is_documented() -> None:
    assert docs_ref.undocumented_metrics() == [], (
        "add these to gspo_megatron/metric_docs.py, then run `python -m gspo_megatron.tools.docs_ref`")


def test_every_config_field_is_documented() -> None:
    from gspo_megatron.config.loader import documented_sections

    missing = [f"{s}.{f.name}" for s, _, fields in documented_sections() for f in fields if not f.doc]
    assert missing == []


def test_registry_names_are_unique_and_in_known_namespaces() -> None:
    names = [m.name for m in metric_docs.METRICS]
    assert len(names) == len(set(names))
    assert {n.split("/", 1)[0] for n in names} <= set(metric_docs.NAMESPACES)


def test_lookup_resolves_families_and_source_fstrings() -> None:
    assert metric_docs.lookup("routing/change_rate/layer_3").name == "routing/change_rate/layer_{i}"
    assert metric_docs.lookup("eval/pass@{n}").name == "eval/pass@{k}"
    assert metric_docs.lookup("routing/rollout/change_rate/layer_1").name == "routing/rollout/{stat}"
    assert metric_docs.lookup("reward/made_up") is None


def test_check_flags_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert docs_ref.main(["--root", str(tmp_path)]) == 0
    assert docs_ref.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / docs_ref.METRICS_MD).write_text("edited by hand\n", encoding="utf-8")
    assert docs_ref.main(["--check", "--root", str(tmp_path)]) == 1
    assert "metrics.md is stale" in capsys.readouterr().err
