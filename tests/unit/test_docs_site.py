"""The docs site builds with ``mkdocs build --strict`` (no warning: every link between pages, every
anchor and every link into the source tree resolves), and the hook that checks links out of
``docs/`` rewrites and flags them as it says. Skipped where mkdocs is not installed (the ``docs``
and ``test`` extras install it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.docs_hooks import outside_target, rewrite_outside_links

ROOT = Path(__file__).resolve().parents[2]


def test_outside_targets_are_resolved_from_the_page() -> None:
    assert outside_target("algorithms.md", "../gspo_megatron/metrics.py") == "gspo_megatron/metrics.py"
    assert outside_target("reference/config.md", "../../README.md#x") == "README.md"
    assert outside_target("reference/config.md", "../gpu.md") is None
    assert outside_target("routing.md", "https://arxiv.org/abs/2507.18071") is None
    assert outside_target("routing.md", "#diagnostics") is None


def test_links_out_of_docs_are_checked_and_rewritten() -> None:
    text = ("[ok](../gspo_megatron/metrics.py) [gone](../gspo_megatron/nope.py) [page](gpu.md)\n"
            "```\n[in code](../nope_in_code.py)\n```\n")
    plain, missing = rewrite_outside_links(text, "x.md", ROOT, repo_url=None)
    assert missing == ["gspo_megatron/nope.py"]
    assert plain.startswith("ok [gone](../gspo_megatron/nope.py) [page](gpu.md)")
    assert "[in code](../nope_in_code.py)" in plain
    linked, _ = rewrite_outside_links("[m](../gspo_megatron/metrics.py#L1)", "x.md", ROOT,
                                      repo_url="https://example.org/r")
    assert linked == "[m](https://example.org/r/blob/main/gspo_megatron/metrics.py#L1)"
    # an image out of docs/ stays an image, pointed at the copy the site serves
    plot = "examples/routing_study/results_frontier/stability_map.png"
    shown, missing = rewrite_outside_links(f"![map](../../{plot})", "guide/x.md", ROOT,
                                           repo_url="https://example.org/r")
    assert missing == [] and shown == f"![map](../{plot})"


def test_site_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").exists()
    from tools.docs_hooks import outside_images

    for rel in outside_images(ROOT / "docs"):  # (the study plots routing.md shows)
        assert (tmp_path / "site" / rel).is_file(), rel


def test_every_command_in_the_readme_and_the_guides_resolves() -> None:
    from tools.doc_commands import check_files

    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").rglob("README.md"))]
    assert check_files(paths) == []


def test_command_checker_flags_what_does_not_exist() -> None:
    from tools.doc_commands import check_command, shell_lines

    assert check_command("make demo && make test PYTEST_ARGS=-q") == []
    assert check_command("gspo-train --config examples/configs/tiny_gspo.yaml --rollout.group_size=8") == []
    assert check_command("OMP_NUM_THREADS=1 python -m tools.bench.rollout --json-out FILE") == []
    assert check_command("make nodemo") == ["make: no target 'nodemo' in the Makefile"]
    assert check_command("gspo-trian --help") == ["gspo-trian: not a console script in setup.py"]
    assert check_command("gspo-train --rollout.group_sise=8") == [
        "--rollout.group_sise: no field 'group_sise' in section 'rollout'"]
    assert check_command("python -m tools.bench.nope") == [
        "python -m tools.bench.nope: no such module in the repository"]
    assert check_command("bash examples/configs/missing.yaml") == [
        "examples/configs/missing.yaml: not in the repository"]
    text = "```console\n$ gspo-plan \\\n  --gpus 16\nout: gspo-nothing\n```\n```yaml\nmake: x\n```\n"
    assert shell_lines(text) == [(2, "gspo-plan  --gpus 16")]


def test_recipe_fragments_in_the_docs_are_checked_against_the_schema() -> None:
    from tools.doc_commands import check_recipe, recipe_blocks

    text = ("```yaml\nrollout:\n  partial_rollouts: true\n  partial_keep_kvv: true\n```\n"
            "```yaml\nnot_a_section: 1\n```\n")
    blocks = recipe_blocks(text)
    assert [no for no, _ in blocks] == [1]
    assert check_recipe(blocks[0][1]) == [
        "rollout.partial_keep_kvv: no field 'partial_keep_kvv' in section 'rollout'"]


def _user_docs() -> list[Path]:
    """The pages a user reads: the README, the guides (docs/**), the examples' READMEs."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "examples").rglob("README.md"))]


def test_no_user_doc_names_an_issue_number() -> None:
    """Our tracker's issue numbers mean nothing to a user ("issue 48"); peers' issues are cited
    by repository (``verl #7356``), which this does not match."""
    import re

    pattern = re.compile(r"\bissues?\s*#?\d+", re.I)
    found = [f"{p.relative_to(ROOT)}:{no}: {m.group(0)}" for p in _user_docs()
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             for m in pattern.finditer(line)]
    assert found == []


def test_make_docs_installs_the_docs_extra_alone() -> None:
    """``make docs`` builds in a venv of the ``docs`` extra's packages, pinned as setup.py pins
    them, and not the training stack (which ``make docs-check`` uses)."""
    import ast
    import re

    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    extras = next(ast.literal_eval(k.value) for node in ast.walk(setup)
                  if isinstance(node, ast.Call) for k in node.keywords
                  if k.arg == "extras_require")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    pins = re.search(r"^DOCS_REQUIREMENTS := (.*)$", makefile, re.M).group(1)
    assert re.findall(r'"([^"]+)"', pins) == extras["docs"]
    rule = makefile.split("\ndocs: ", 1)[1].split("\n\n", 1)[0]
    assert "DOCS_VENV" in rule and "$(PY)" not in rule and "VENV)/.installed" not in rule.replace(
        "DOCS_VENV)/.installed", "")


def test_the_recipes_guide_lists_every_section_and_a_page_links_it() -> None:
    from gspo_megatron.config.loader import section_types

    guide = (ROOT / "examples" / "configs" / "README.md").read_text(encoding="utf-8")
    intro = guide.split("\n\n")[1]  # "A recipe is a YAML file whose top-level keys are ..."
    assert [s for s in section_types() if f"`{s}`" not in intro] == []
    linked = [p for p in _user_docs() if "configs/README.md" in p.read_text(encoding="utf-8")]
    assert any(p.parent.name == "docs" for p in linked)
