"""Check the shell commands in the README and the guides against the tree (no command is run).

    python tools/doc_commands.py README.md docs/*.md     # one line per problem; exit 1 if any

For every line of a fenced ``bash`` / ``sh`` / ``console`` block (continuations joined, ``$ ``
prompts and comments dropped, ``&&`` / ``;`` / ``|`` split), it checks what can be checked
without running anything:

* ``make TARGET``: the target is in the Makefile;
* a console script (``gspo-train``, ``gspo-plan``, ...): it is in ``setup.py``'s entry points;
* ``--section.field=...`` given to ``gspo-train``, ``gspo-plan`` or a ``launch/`` script: the
  section and field exist in the config schema;
* ``python -m pkg.mod`` and ``python path.py``: the module or file exists in the repository
  (modules outside it, such as ``pip``, are not checked);
* any argument that looks like a path into the repository (``examples/...``, ``launch/...``,
  ``tools/...``, ``tests/...``, ``gspo_megatron/...``, ``docs/...``): it exists.

A fenced ``yaml`` block whose top-level keys are all config sections is a recipe fragment: each
of its fields must exist in the schema.

``make docs`` runs it over ``README.md`` and ``docs/``; ``tests/unit/test_docs_site.py`` too.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELLS = {"bash", "sh", "shell", "console"}
_REPO_DIRS = ("examples/", "launch/", "tools/", "tests/", "gspo_megatron/", "docs/")
_CONFIG_TAKERS = ("gspo-train", "gspo-plan")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for each command of the fenced shell blocks of a Markdown text.

    In a block that shows ``$ `` prompts only the prompted lines are commands (the rest is their
    output); elsewhere every line that is not a comment is."""
    out: list[tuple[int, str]] = []
    block: list[tuple[int, str]] | None = None
    for no, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line.strip())
        if fence and block is None:
            block = [] if fence[1] in _SHELLS else [(-1, "")]
        elif fence:
            if not block or block[0][0] != -1:
                out.extend(_commands(block or []))
            block = None
        elif block is not None:
            block.append((no, line.strip()))
    return out


def _commands(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    prompted = any(body.startswith("$ ") for _, body in block)
    out, pending, start = [], "", 0
    for no, body in block:
        if not pending:
            if prompted and not body.startswith("$ "):
                continue
            body = body[2:] if prompted else body
            if body.startswith("#") or not body:
                continue
            start = no
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        out.append((start, pending + body))
        pending = ""
    return out


def recipe_blocks(text: str) -> list[tuple[int, dict]]:
    """``(line of the fence, mapping)`` for each fenced ``yaml`` block of a Markdown text whose
    top-level keys are all config sections (a recipe fragment)."""
    import yaml

    sections = set(_config_fields())
    out, start, body = [], 0, None
    for no, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line.strip())
        if fence and body is None and fence[1] == "yaml":
            start, body = no, []
        elif line.strip() == "```" and body is not None:
            try:
                data = yaml.safe_load("\n".join(body))
            except yaml.YAMLError:
                data = None
            if isinstance(data, dict) and data and set(data) <= sections:
                out.append((start, data))
            body = None
        elif body is not None:
            body.append(line)
    return out


def check_recipe(data: dict) -> list[str]:
    """The fields of a recipe fragment that are not in the schema."""
    fields = _config_fields()
    return [f"{section}.{name}: no field {name!r} in section {section!r}"
            for section, values in data.items() if isinstance(values, dict)
            for name in values if name not in fields[section]]


def _make_targets(root: Path) -> set[str]:
    text = (root / "Makefile").read_text(encoding="utf-8")
    return {m for line in text.splitlines()
            for m in re.findall(r"^([A-Za-z0-9_.-]+)(?=\s*:(?!=))", line)}


def _console_scripts(root: Path) -> set[str]:
    return set(re.findall(r'"([\w-]+)=[\w.]+:\w+"', (root / "setup.py").read_text(encoding="utf-8")))


def _config_fields() -> dict[str, set[str]]:
    import dataclasses

    from gspo_megatron.config.loader import section_types

    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in section_types().items()}


def _module_exists(root: Path, module: str) -> bool | None:
    """True / False for a module of this repository; None for one from elsewhere."""
    parts = module.split(".")
    if not (root / parts[0]).exists() and not (root / f"{parts[0]}.py").exists():
        return None
    base = root.joinpath(*parts)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists() or (
        base / "__main__.py").exists() or base.is_dir()


def check_command(command: str, root: Path = ROOT) -> list[str]:
    """The problems of one shell command (empty when every checkable part resolves)."""
    problems: list[str] = []
    for part in re.split(r"&&|\|\||;|\|", command):
        try:
            words = shlex.split(part, comments=True)
        except ValueError as err:
            problems.append(f"cannot parse {part.strip()!r}: {err}")
            continue
        while words and _ASSIGN.match(words[0]):
            words = words[1:]
        if not words:
            continue
        program, args = words[0], words[1:]
        if program.startswith(("./", ".venv/bin/")):
            program = program.split("/")[-1] if program.startswith(".venv/bin/") else program[2:]
        if program == "make":
            targets = _make_targets(root)
            for target in (a for a in args if not a.startswith("-") and "=" not in a):
                if target not in targets:
                    problems.append(f"make: no target {target!r} in the Makefile")
        elif program.startswith("gspo-") and program not in _console_scripts(root):
            problems.append(f"{program}: not a console script in setup.py")
        if program in ("python", "python3") and args[:1] == ["-m"] and len(args) > 1:
            if "<" not in args[1] and _module_exists(root, args[1]) is False:
                problems.append(f"python -m {args[1]}: no such module in the repository")
        if program in _CONFIG_TAKERS or program.startswith("launch/"):
            problems.extend(_check_overrides(args))
        for arg in [program, *args]:
            path = arg.split("=", 1)[-1] if arg.startswith("--") else arg
            if path.startswith(_REPO_DIRS) and "*" not in path and "<" not in path:
                if not (root / path.split("::")[0]).exists():
                    problems.append(f"{path}: not in the repository")
    return problems


def _check_overrides(args: list[str]) -> list[str]:
    fields = _config_fields()
    problems = []
    for arg in args:
        m = re.match(r"--([a-z_]+)\.([a-z_0-9]+)(?:=|$)", arg)
        if not m:
            continue
        section, name = m[1], m[2]
        if section not in fields:
            problems.append(f"--{section}.{name}: no config section {section!r}")
        elif name not in fields[section]:
            problems.append(f"--{section}.{name}: no field {name!r} in section {section!r}")
    return problems


def check_files(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``"file:line: problem"`` for every command of every file."""
    out = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        shown = path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path
        for no, command in shell_lines(text):
            out.extend(f"{shown}:{no}: {p}" for p in check_command(command, root))
        for no, data in recipe_blocks(text):
            out.extend(f"{shown}:{no}: {p}" for p in check_recipe(data))
    return out


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    problems = check_files(paths)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
