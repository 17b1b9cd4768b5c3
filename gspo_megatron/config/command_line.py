"""``gspo-train``'s command line: the recipe, ``--section.field=value`` overrides and the flags
(``--verbose``, ``--check``, ``--gpus``, ``--version``, ``--help [SECTION]``).

Parsing only: nothing is loaded or validated here (:func:`~.loader.load_config` does that), so a
bad argument is one line before anything else runs.
"""

from __future__ import annotations

import typing
from typing import Sequence

from gspo_megatron.config.validation import ConfigError

USAGE = """\
usage: gspo-train [--config RECIPE.yaml] [--section.field=VALUE | --section.field VALUE ...]
                  [--check [--gpus N]] [--verbose] [--version] [--help [SECTION]]

--check validates the run without starting it: the recipe and overrides, the layout on N GPUs
(--gpus, else $WORLD_SIZE, else the layout's smallest), the directories it writes, the data
(readable, prompts within data.max_prompt_length), the reward (importable), the tokenizer and the
checkpoint it starts from (reachable, the model's shapes), and the memory plan (gspo-plan, GPU
memory $GPU_MEMORY_GIB, default 80). One line per problem, then one verdict; exit 0 (ok) or 2.
Nothing is written.
--help SECTION prints one section's fields (e.g. --help loss); --help alone, every section.
--verbose shows the Python warnings and the Megatron/Apex log messages below ERROR that are hidden
by default (fallback notices at start-up); gspo_megatron's own warnings are always shown.
Without --config, gspo-train runs the CPU demo recipe (gspo_megatron/config/recipes/demo.yaml).
Every field of the recipe can be overridden; values are YAML scalars (3e-4, true, null, [1,0,1]).
A field a recipe leaves out takes the default listed below (the paper's and production's).
A 'model.preset' (tiny, qwen3-30b-a3b, qwen3-235b-a22b) fills the model fields not set explicitly;
any other preset name is a free label. With --checkpoint.init_weights=DIR holding a converted
model's model_config.json (gspo-convert-hf), the model comes from that file: a model field given
here that is architecture (not seq_length, the aux-loss, dispatcher, router-dtype or init settings)
must agree with it.
"""


def _section_of(name: str, value: str) -> str:
    """``"; did you mean --rollout.group_size=8?"`` when ``name`` is a field of some sections
    (a top-level key given without its section), else ``""``."""
    from gspo_megatron.config.loader import field_types, section_types

    fields = [f"--{section}.{name}" for section, cls in section_types().items()
              if name in field_types(cls)]
    if not fields:
        return ""
    shown = [f + (f"={value}" if value else "") for f in fields]
    return f"; did you mean {' or '.join(shown)}?"


class CommandLine(typing.NamedTuple):
    """``gspo-train``'s arguments: the recipe, the overrides and the flags."""

    config: str | None
    overrides: list[str]
    verbose: bool = False
    check: bool = False
    """``--check``: validate everything the run would read, start nothing, write nothing."""
    gpus: int | None = None
    """``--gpus N``: the world size ``--check`` validates the layout and memory plan for."""


def version_line() -> str:
    """``gspo-train X.Y.Z (megatron-core A, torch B, Python C)``: what ``--version`` prints; the
    versions of the dependencies that decide what runs, read from package metadata (no import)."""
    import platform
    from importlib import metadata

    import gspo_megatron

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"gspo-train {gspo_megatron.__version__} (megatron-core {installed('megatron-core')}, torch "
            f"{installed('torch')}, Python {platform.python_version()})")


def print_help(section: str | None) -> None:
    """The usage and every field's documentation, or one section's (``--help loss``); an unknown
    section is a :class:`ConfigError` naming the sections."""
    from gspo_megatron.config.coerce import suggest
    from gspo_megatron.config.loader import describe_config, section_types

    if section is None:
        print(USAGE)
        print(describe_config())
        return
    sections = section_types()
    if section not in sections:
        raise ConfigError(f"--help {section}: unknown section{suggest(section, sections)} "
                          f"(sections: {', '.join(sections)})")
    print(describe_config([section]))


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(config_path, overrides)`` of :func:`parse_command_line`, for :func:`load_config`."""
    return parse_command_line(argv)[:2]


def parse_command_line(argv: Sequence[str]) -> CommandLine:
    """Split ``argv`` into the recipe, the overrides and the flags.

    Accepts ``--config PATH`` / ``--config=PATH`` / ``-c PATH``, ``--verbose``, ``--check``,
    ``--gpus N``, ``--section.field=value``, ``--section.field value``, ``section.field=value``,
    and a bare ``--section.field`` (= true, for bool fields). ``-h`` / ``--help [SECTION]`` prints
    the fields' documentation and ``--version`` the versions, then exit (``SystemExit(0)``).
    """
    argv = list(argv)
    config: str | None = None
    overrides: list[str] = []
    verbose = check = False
    gpus: int | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--verbose":
            verbose, i = True, i + 1
            continue
        if arg == "--check":
            check, i = True, i + 1
            continue
        if arg == "--version":
            print(version_line())
            raise SystemExit(0)
        if arg in ("-h", "--help"):
            # A following word that is no flag is the section to show.
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
            print_help(nxt)
            raise SystemExit(0)
        if arg == "--gpus" or arg.startswith("--gpus="):
            value, i = ((arg.partition("=")[2], i + 1) if "=" in arg
                        else (argv[i + 1] if i + 1 < len(argv) else "", i + 2))
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--gpus needs a positive number of GPUs, got {value!r}")
            gpus = int(value)
            continue
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a path")
            config, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config, i = arg.partition("=")[2], i + 1
            continue
        body = arg[2:] if arg.startswith("--") else arg
        key, sep, _ = body.partition("=")
        if "." not in key or (not sep and not arg.startswith("--")):
            hint = _section_of(key, arg.partition("=")[2])
            raise ConfigError(f"unrecognised argument {arg!r}" + (hint or (
                "; expected --config PATH, --section.field=value or a flag (--check, --gpus N, "
                "--verbose, --version, --help [SECTION])")))
        if sep:
            overrides.append(arg)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            overrides.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            overrides.append(f"{arg}=true")
            i += 1
    if gpus is not None and not check:
        raise ConfigError("--gpus is for --check (a run's world size is torchrun's)")
    return CommandLine(config, overrides, verbose, check, gpus)
