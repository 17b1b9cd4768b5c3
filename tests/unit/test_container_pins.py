"""launch/Containerfile installs what setup.py and the Makefile pin: the same megatron-core, the
extras setup.py defines, the files the package needs (a stale pin would build an image whose
trainer refuses to start: gspo_megatron.compat checks the megatron-core line)."""

import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def container_args() -> dict[str, str]:
    text = (ROOT / "launch" / "Containerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def setup_py() -> str:
    return (ROOT / "setup.py").read_text()


def test_megatron_core_pin_matches_setup_py_and_makefile():
    from gspo_megatron.compat import SUPPORTED_MEGATRON

    pinned = container_args()["MCORE_VERSION"]
    makefile = re.search(r"^MCORE_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert pinned == makefile
    spec = next(Requirement(r) for r in re.findall(r'"(megatron-core[^"]*)"', setup_py()))
    assert spec.specifier.contains(pinned), (pinned, str(spec))
    assert pinned.startswith(SUPPORTED_MEGATRON)


def test_extras_and_copied_files_exist():
    extras = container_args()["EXTRAS"].split(",") + ["gpu"]
    defined = re.findall(r'^\s+"([\w-]+)": \[', setup_py(), re.M)
    assert set(extras) <= set(defined), set(extras) - set(defined)
    text = (ROOT / "launch" / "Containerfile").read_text()
    for copied in re.findall(r"^COPY (.+) \./", text, re.M):
        for name in copied.split():
            assert (ROOT / name).exists(), name
    # setup.py reads README.md and gspo_megatron/__init__.py: both are copied.
    assert "README.md" in text and "COPY gspo_megatron " in text
    assert container_args()["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
