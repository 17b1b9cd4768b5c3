"""Where a recorded figure came from: the commit (``+dirty`` when the measured code had uncommitted
changes) and the time, for the result files under docs/results/ and the study reports."""

from __future__ import annotations

import datetime
import os
import subprocess
from collections.abc import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(paths: Sequence[str] = ("gspo_megatron",), root: str = REPO_ROOT) -> str:
    """HEAD's hash, with ``+dirty`` when any of ``paths`` (relative to ``root``) has changed or
    untracked files (the figures then describe uncommitted code); ``"unknown"`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def utc_now() -> str:
    """``2026-11-23 18:04 UTC``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
