"""mkdocs hooks (``mkdocs.yml``: ``hooks: [tools/docs_hooks.py]``): links out of ``docs/``.

The guides link to the source tree (``[registry.py](../gspo_megatron/algorithms/losses/registry.py)``),
which GitHub renders as links but mkdocs cannot serve. Before mkdocs reads a page, each such link
is checked: a target that does not exist in the repository is a warning (so ``mkdocs build
--strict`` fails on it, as it does on a broken link between pages); one that exists becomes a link
to ``repo_url``'s copy when ``repo_url`` is set, else its text. Images out of ``docs/`` (a study's
plots beside its results, ``![map](../examples/.../stability_map.png)``) are served by the site:
each is added to mkdocs' files under its repository path and the page points there. Links between
pages, anchors included, are mkdocs' own ``validation`` checks.
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
_IMAGE = re.compile(r"!\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
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
        if match[0].startswith("!"):  # an image: served from the site (on_files)
            here = posixpath.dirname(page_src)
            return f"![{match['text']}]({posixpath.relpath(rel, here or '.')})"
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
            out.append(piece if in_code else _IMAGE.sub(fix, _LINK.sub(fix, piece)))
    return "".join(out), missing


def outside_images(docs_dir: Path) -> list[str]:
    """The repository paths of the images the pages under ``docs_dir`` show from outside it."""
    found = set()
    for page in sorted(docs_dir.rglob("*.md")):
        src = page.relative_to(docs_dir).as_posix()
        for piece in _FENCE.split(page.read_text())[::2]:  # (odd pieces: code blocks)
            for match in _IMAGE.finditer(piece):
                rel = outside_target(src, match["target"])
                if rel is not None and (docs_dir.parent / rel).is_file():
                    found.add(rel)
    return sorted(found)


def on_files(files: Any, config: Any) -> Any:
    """mkdocs event: the images pages show from outside ``docs/``, served at their repository
    paths."""
    from mkdocs.structure.files import File

    docs_dir = Path(config["docs_dir"]).resolve()
    for rel in outside_images(docs_dir):
        files.append(File(rel, str(docs_dir.parent), config["site_dir"],
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs event: rewrite and check the page's links that leave ``docs/``."""
    root = Path(config["docs_dir"]).resolve().parent
    text, missing = rewrite_outside_links(markdown, page.file.src_uri, root, config.get("repo_url"))
    for rel in missing:
        log.warning("Doc file '%s' links to '%s', which is not in the repository.",
                    page.file.src_uri, rel)
    return text
