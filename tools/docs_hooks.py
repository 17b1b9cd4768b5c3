"""mkdocs hooks (``mkdocs.yml``: ``hooks: [tools/docs_hooks.py]``): links out of ``docs/``.

The guides link to the source tree (``[registry.py](../gspo_megatron/algorithms/losses/registry.py)``),
which GitHub renders as links but mkdocs cannot serve. Before mkdocs reads a page, each such link
is checked: a target that does not exist in the repository is a warning (so ``mkdocs build
--strict`` fails on it, as it does on a broken link between pages); one that exists becomes a link
to ``repo_url``'s copy when ``repo_url`` is set, else its text. Links between pages, anchors
included, are mkdocs' own ``validation`` checks.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.gspo_docs_hooks")

# [text](target) or [text](target "title"), not an image; fenced code is skipped separately.
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def outside_target(page_src: str, target: str) -> str | None:
    """The repository path a page's relative link points to when it leaves ``docs/``, else None.

    ``page_src`` is the page's path under ``docs/`` (``reference/config.md``); the fragment is
    dropped (``../README.md#x`` -> ``README.md``)."""
    if _EXTERNAL.match(target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), path))
    return None if joined == "docs" or joined.startswith("docs/") else joined


def rewrite_outside_links(markdown: str, page_src: str, root: Path, repo_url: str | None,
                          branch: str = "main") -> tuple[str, list[str]]:
    """``(markdown with links out of docs/ rewritten, the targets that do not exist)``."""
    missing: list[str] = []

    def fix(match: re.Match[str]) -> str:
        rel = outside_target(page_src, match["target"])
        if rel is None:
            return match[0]
        if not (root / rel).exists():
            missing.append(rel)
            return match[0]
        if repo_url:
            kind = "tree" if (root / rel).is_dir() else "blob"
            anchor = match["target"].partition("#")[2]
            url = f"{repo_url.rstrip('/')}/{kind}/{branch}/{rel}" + (f"#{anchor}" if anchor else "")
            return f"[{match['text']}]({url})"
        return match["text"]

    # Odd pieces between fences are code blocks: left alone.
    pieces = _FENCE.split(markdown)
    out, in_code = [], False
    for piece in pieces:
        if piece in ("```", "~~~"):
            in_code = not in_code
            out.append(piece)
        else:
            out.append(piece if in_code else _LINK.sub(fix, piece))
    return "".join(out), missing


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs event: rewrite and check the page's links that leave ``docs/``."""
    root = Path(config["docs_dir"]).resolve().parent
    text, missing = rewrite_outside_links(markdown, page.file.src_uri, root, config.get("repo_url"))
    for rel in missing:
        log.warning("Doc file '%s' links to '%s', which is not in the repository.",
                    page.file.src_uri, rel)
    return text
