"""Load, override, validate, save and document a :class:`~gspo_megatron.config.TrainConfig`.

A recipe is a YAML file whose top-level keys are the sections of ``TrainConfig`` (its fields,
listed by ``gspo-train --help``: ``model``, ``parallel``, ``precision``, ``optim``, ``loss``, ...)::

    model:
      preset: qwen3-30b-a3b     # fills every other model field from MODEL_PRESETS ...
      seq_length: 5120          # ... explicit keys win
    rollout:
      group_size: 16

Training from a converted checkpoint (``checkpoint.init_weights: DIR`` with ``DIR/model_config.json``
from ``gspo-convert-hf``), the model comes from that file: the recipe needs no model section, and
an architecture field it does set must agree with the file (``model.ARCHITECTURE_FIELDS``);
``seq_length`` and the other ``model.TRAINING_FIELDS`` are free. See :func:`load_config`.

Command-line overrides are ``--section.field=value`` (or ``section.field=value``; ``parse_cli``
also takes ``--section.field value``); ``--section.field.key=value`` sets one key of a mapping
field (``--loss.gspo.clip_low=0.02``), keeping the recipe's other keys. Values are parsed as YAML scalars and coerced to the
field's annotated type (``int``, ``float`` incl. ``3e-4``, ``bool``, ``str``, ``X | None`` with
``null``/``none``, ``Literal[...]``, ``list[int]`` like ``[1,0,1]``, ``int | list[int]``).

Every problem raises :class:`ConfigError` (a ``ValueError``) naming the source (``file:line``
or the override), the field path and the bad value, before any compute::

    tiny.yaml:12: rollout.group_szie: unknown field; did you mean 'group_size'?
    tiny.yaml:14: rollout.top_p: must be in (0, 1], got 1.5
    override '--loss.variant=GSPO': loss.variant: expected one of 'gspo', 'gspo_token', 'grpo',
        got 'GSPO'; did you mean 'gspo'?

:func:`load_config` checks names, types and each section's own fields (every section is a
:class:`~gspo_megatron.sections.Section`: its ``_problems``, run on construction);
:func:`~gspo_megatron.config.validation.validate_config` checks the sections against each
other and the world size. Type coercion is :mod:`.coerce`. Files are read with
``yaml.safe_load`` only (no Python tags). Fields a recipe leaves out take the library's
(production) defaults; ``DEMO_RECIPE`` is the CPU demo's recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import textwrap
import typing
from typing import Any, Iterable, Sequence

import yaml

from gspo_megatron.sections import FieldError, field_docs
from gspo_megatron.config.coerce import (NULL_WORDS, CoerceError, accepts_str, coerce, suggest,
                                         type_name)
from gspo_megatron.config.model import (ARCHITECTURE_FIELDS, MODEL_PRESETS, SHAPE_FIELDS,
                                        ModelConfig, ModelFileError, model_config_file,
                                        read_model_config_file, same_architecture_value,
                                        show_value)
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.config.validation import ConfigError, ConfigWarning, validate_config
# The command line is parsed in .command_line; its names stay importable from here.
from gspo_megatron.config.command_line import CommandLine, parse_cli, parse_command_line

__all__ = [
    "DEMO_RECIPE",
    "CommandLine",
    "ConfigError",
    "ConfigWarning",
    "config_from_argv",
    "config_to_dict",
    "describe_config",
    "field_docs",
    "load_config",
    "parse_cli",
    "parse_command_line",
    "save_config",
    "section_types",
    "validate_config",
]


DEMO_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes", "demo.yaml")
"""The CPU demo (a tiny model trained from scratch on the built-in arithmetic task): the recipe
``gspo-train`` runs when given no ``--config``. Shipped inside the package."""

# ------------------------------------------------------------------------------------ schema


@functools.lru_cache(maxsize=None)
def section_types() -> dict[str, type]:
    """``{section name: dataclass}`` for the sections of :class:`TrainConfig`."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


# ------------------------------------------------------------------------------------ loading


@dataclasses.dataclass
class _Entry:
    value: Any
    source: str  # "file.yaml:12", "override '--a.b=c'", "preset 'tiny'", ".../model_config.json"
    raw: str | None = None  # the override's text, used as-is for str fields
    from_preset: bool = False  # filled in (model.preset, model_config.json), not written by the user


def _yaml_error(path: str, e: yaml.YAMLError) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    detail = f"{context}; {problem}" if context else problem
    if isinstance(e, yaml.constructor.ConstructorError):
        detail += " (recipes are read with yaml.safe_load: plain YAML only, no Python tags)"
    return ConfigError(f"{where}: invalid YAML: {detail}")


def _read_yaml(path: str) -> tuple[dict[str, dict[str, _Entry]], list[str]]:
    """``{section: {field: entry}}`` from a recipe, with the line of each key; plus errors."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start}); save the recipe as UTF-8") from e
    try:
        data = yaml.safe_load(text)  # never yaml.load: no Python object tags
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from e
    if data is None:
        return {}, []
    if not isinstance(data, dict) or not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: the top level must be a mapping of sections "
                          f"({', '.join(section_types())}), got {type(data).__name__}")

    errors: list[str] = []
    sections = section_types()
    out: dict[str, dict[str, _Entry]] = {}
    seen_sections: set[str] = set()
    for knode, vnode in root.value:
        line = knode.start_mark.line + 1
        where = f"{path}:{line}"
        name = knode.value
        if not isinstance(knode, yaml.ScalarNode) or knode.tag != "tag:yaml.org,2002:str":
            errors.append(f"{where}: section names must be strings, got {name!r}")
            continue
        if name in seen_sections:
            errors.append(f"{where}: {name}: duplicate section")
            continue
        seen_sections.add(name)
        if name not in sections:
            errors.append(f"{where}: {name}: unknown section{suggest(name, sections)} "
                          f"(sections: {', '.join(sections)})")
            continue
        value = data[name]
        if value is None:
            out[name] = {}
            continue
        if not isinstance(value, dict) or not isinstance(vnode, yaml.MappingNode):
            errors.append(f"{where}: {name}: a section must be a mapping of fields, "
                          f"got {value!r}")
            continue
        entries: dict[str, _Entry] = {}
        for fknode, _ in vnode.value:
            fline = fknode.start_mark.line + 1
            fname = fknode.value
            if not isinstance(fknode, yaml.ScalarNode) or fknode.tag != "tag:yaml.org,2002:str":
                errors.append(f"{path}:{fline}: {name}: field names must be strings, got {fname!r}")
                continue
            if fname in entries:
                errors.append(f"{path}:{fline}: {name}.{fname}: duplicate field "
                              f"(first at {entries[fname].source})")
                continue
            entries[fname] = _Entry(value[fname], f"{path}:{fline}")
        out[name] = entries
    return out, errors


def _split_override(text: str) -> tuple[str, str]:
    body = text[2:] if text.startswith("--") else text
    key, sep, value = body.partition("=")
    if not sep:
        raise ConfigError(f"override {text!r}: expected --section.field=value")
    return key.strip(), value


def _parse_override_value(value: str) -> Any:
    try:
        return yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        return value


def _apply_overrides(raw: dict[str, dict[str, _Entry]], overrides: Iterable[str],
                     errors: list[str]) -> None:
    sections = section_types()
    for text in overrides:
        if not isinstance(text, str):
            errors.append(f"override {text!r}: expected a string --section.field=value")
            continue
        try:
            key, value = _split_override(text)
        except ConfigError as e:
            errors.extend(e.errors)
            continue
        source = f"override {text!r}"
        section, dot, fname = key.partition(".")
        fname, subdot, sub = fname.partition(".")
        if not dot or not fname or "." in sub or (subdot and not sub):
            errors.append(f"{source}: {key!r} is not section.field "
                          f"(sections: {', '.join(sections)})")
            continue
        if section not in sections:
            errors.append(f"{source}: {section}: unknown section{suggest(section, sections)}")
            continue
        entries = raw.setdefault(section, {})
        if sub:
            # --loss.gspo.clip_low=0.02: one key of a mapping field, merged into the recipe's.
            before = entries.get(fname)
            mapping = dict(before.value) if before is not None and isinstance(
                before.value, dict) else {}
            mapping[sub] = _parse_override_value(value)
            entries[fname] = _Entry(mapping, source)
        else:
            entries[fname] = _Entry(_parse_override_value(value), source, value)


def _coerce_entry(path: str, entry: _Entry, tp: Any) -> Any:
    value = entry.value
    if entry.raw is not None and accepts_str(tp) and not (
            type(None) in typing.get_args(tp) and entry.raw.strip().lower() in NULL_WORDS):
        value = entry.raw  # "--logging.run_dir=007" stays the string "007"
    try:
        return coerce(value, tp)
    except CoerceError as e:
        raise ConfigError(f"{entry.source}: {path}: {e}, got {value!r}{e.hint}") from None


def _init_weights_model_file(raw: dict[str, dict[str, _Entry]]) -> str | None:
    """The model_config.json of ``checkpoint.init_weights`` (recipe or override), if it has one."""
    entry = raw.get("checkpoint", {}).get("init_weights")
    if entry is None:
        return None
    try:
        value = _coerce_entry("checkpoint.init_weights", entry, str | None)
    except ConfigError:
        return None  # reported when the section is built
    return model_config_file(value)


def _said_by(entry: _Entry) -> str:
    return "the override" if entry.raw is not None else "the recipe"


def _apply_model_file(entries: dict[str, _Entry], path: str, preset: str | None,
                      errors: list[str]) -> bool:
    """Take the model from a converted checkpoint's ``model_config.json``: each architecture field
    the recipe, an override or the known preset ``preset`` sets must equal the file's (one error
    per field naming both values); every field still unset takes the file's value, and the label
    ``model.preset`` the file's (or its directory's name). False when the file is malformed."""
    try:
        values = read_model_config_file(path)
    except ModelFileError as e:
        errors.extend(e.errors)
        return False
    reference = ModelConfig(**values)
    ftypes = field_types(ModelConfig)
    preset_values = MODEL_PRESETS.get(preset, {}) if preset is not None else {}
    for field in ARCHITECTURE_FIELDS:
        if field in entries:
            entry = entries[field]
            try:
                value = _coerce_entry(f"model.{field}", entry, ftypes[field])
            except ConfigError:
                continue  # reported when the section is built
            source, who = entry.source, _said_by(entry)
        elif field in preset_values:
            value = preset_values[field]
            source, who = entries["preset"].source, f"preset {preset!r}"
        else:
            continue
        if not same_architecture_value(field, value, reference):
            errors.append(f"{source}: model.{field}: {who} says {show_value(value)}, "
                          f"{path} says {show_value(getattr(reference, field))}")
            # Already refused: build the section with the file's value, so that the section's
            # own checks do not add errors that follow only from this one.
            entries[field] = _Entry(getattr(reference, field), path, from_preset=True)
    for field, value in values.items():
        if field != "preset":
            entries.setdefault(field, _Entry(value, path, from_preset=True))
    if "preset" not in entries:
        label = values.get("preset") or os.path.basename(os.path.dirname(os.path.abspath(path)))
        entries["preset"] = _Entry(label, path, from_preset=True)
    return True


def _resolve_model(entries: dict[str, _Entry], model_file: str | None, errors: list[str]) -> None:
    """Fill the model fields the recipe and the overrides leave out: from ``model_file``
    (``checkpoint.init_weights/model_config.json``) when there is one, then from a known
    ``model.preset``. A preset name that is not in ``MODEL_PRESETS`` is a free label: accepted when
    the shape comes from ``model_file`` or every ``SHAPE_FIELDS`` entry is set, refused otherwise."""
    name = None
    if "preset" in entries:
        try:
            name = _coerce_entry("model.preset", entries["preset"], str)
        except ConfigError as e:
            errors.extend(e.errors)
            return
    if name is not None and name not in MODEL_PRESETS and model_file is None:
        missing = [f for f in SHAPE_FIELDS if f not in entries]
        if missing:
            errors.append(
                f"{entries['preset'].source}: model.preset: unknown preset {name!r}"
                f"{suggest(name, MODEL_PRESETS)} (presets: {', '.join(MODEL_PRESETS)}; any other "
                "name is a free label, which needs checkpoint.init_weights with a "
                "model_config.json or every shape field set: missing "
                f"{', '.join('model.' + f for f in missing)})")
            return
    if model_file is not None:
        if not _apply_model_file(entries, model_file, name, errors):
            return
    if name in MODEL_PRESETS:
        for key, value in MODEL_PRESETS[name].items():
            entries.setdefault(key, _Entry(value, f"preset {name!r}", from_preset=True))


def _source_of(fields: Iterable[str], entries: dict[str, _Entry]) -> str:
    """Where the first of ``fields`` that the recipe or an override set came from (a preset's
    value only when none was set explicitly; every source of the section when none is known)."""
    given = [entries[f] for f in fields if f in entries]
    entry = next((e for e in given if not e.from_preset), given[0] if given else None)
    if entry is not None:
        return entry.source
    return ", ".join(sorted({e.source for e in entries.values()})) or "defaults"


def _constructor_errors(section: str, e: FieldError, entries: dict[str, _Entry],
                        unparsed: set[str]) -> list[str]:
    """``file:line: section.field: problem`` lines for a section's constructor failure: every
    section is a :class:`Section`, whose :class:`FieldError` names the fields of each problem.
    A problem involving a field whose value failed to parse (``unparsed``: it holds its default
    meanwhile) is left out: it would judge a value the user never gave."""
    return [f"{_source_of(fields, entries)}: {section}.{fields[0]}: {text}"
            for fields, text in e.problems if not unparsed.intersection(fields)]


def _build_section(section: str, cls: type, default: Any, entries: dict[str, _Entry],
                   errors: list[str]) -> Any:
    """The section from its ``default`` (TrainConfig's) updated by ``entries``; ``None`` and
    ``errors`` extended when a name, a type or the section's own checks fail."""
    ftypes = field_types(cls)
    kwargs: dict[str, Any] = {name: getattr(default, name) for name in ftypes}
    unparsed: set[str] = set()
    for fname, entry in entries.items():
        path = f"{section}.{fname}"
        if fname not in ftypes:
            errors.append(f"{entry.source}: {path}: unknown field{suggest(fname, ftypes)}")
            continue
        try:
            kwargs[fname] = _coerce_entry(path, entry, ftypes[fname])
        except ConfigError as e:
            errors.extend(e.errors)
            unparsed.add(fname)
    try:
        section_cfg = cls(**kwargs)  # every section checks its own fields on construction
    except FieldError as e:
        errors.extend(_constructor_errors(section, e, entries, unparsed))
        return None
    return None if unparsed else section_cfg


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Build a :class:`TrainConfig` from a YAML recipe (or the defaults) plus overrides.

    Args:
        path: A YAML recipe (``DEMO_RECIPE`` for the CPU demo), or ``None`` for the library's
            defaults (production hyperparameters; see :mod:`gspo_megatron.config.schema`).
        overrides: ``"--section.field=value"`` / ``"section.field=value"`` strings, applied after
            the file (a ``model.preset`` override fills the model fields not set explicitly).

    With ``checkpoint.init_weights`` pointing at a converted checkpoint that has a
    ``model_config.json``, the model fields not set explicitly come from that file; an
    architecture field (``model.ARCHITECTURE_FIELDS``) the recipe, an override or a known preset
    sets must equal the file's, and each one that does not is an error naming the field and both
    values. Training fields (``model.TRAINING_FIELDS``: ``seq_length`` ...) are free. Without
    that file (e.g. ``sft_weights`` from gspo-train) nothing changes.

    Raises:
        ConfigError: unreadable/invalid YAML or a Python tag, unknown section or field (with a
            suggestion), a malformed model_config.json or one that disagrees with the recipe, a value of the wrong type or outside a ``Literal`` (with a suggestion),
            or a value its section refuses (``rollout.top_p: must be in (0, 1], got 1.5``); each
            line starts with ``file:line`` or the override that set the field.

    Names, types and each section's own fields are checked here; call :func:`validate_config`
    for the checks across sections (batch divisibility, parallel layout vs world size, lengths,
    paths, reward name).
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    errors: list[str] = []
    raw: dict[str, dict[str, _Entry]] = {}
    if path is not None:
        raw, errors = _read_yaml(os.fspath(path))
    _apply_overrides(raw, overrides, errors)
    model_file = _init_weights_model_file(raw)
    if model_file is not None:
        raw.setdefault("model", {})
    if "model" in raw:
        _resolve_model(raw["model"], model_file, errors)
    defaults = TrainConfig()
    built: dict[str, Any] = {}
    for section, cls in section_types().items():
        built[section] = _build_section(section, cls, getattr(defaults, section),
                                        raw.get(section, {}), errors)
    if errors:
        raise ConfigError(errors)
    return TrainConfig(**built)


# ----------------------------------------------------------------------------- saving, docs


def config_to_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}`` of plain Python values (YAML-serialisable)."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return {
        f.name: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, f.name)).items()}
        for f in dataclasses.fields(cfg)
    }


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write ``cfg`` as a YAML recipe that :func:`load_config` reads back to an equal config."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Resolved gspo_megatron TrainConfig (gspo_megatron.config.loader.save_config).\n")
        f.write(text)


class FieldDoc(typing.NamedTuple):
    """One ``--section.field``: its type, default (as YAML) and docstring."""

    name: str
    type: str
    default: str
    doc: str


def documented_sections(sections: Iterable[str] | None = None) -> list[tuple[str, str, list[FieldDoc]]]:
    """``(section, section docstring, its fields)`` for each section, in :class:`TrainConfig`'s
    order: what ``gspo-train --help`` prints and ``docs/reference/config.md`` is generated from."""
    defaults = TrainConfig()
    out = []
    for section in (list(sections) if sections is not None else list(section_types())):
        cls = section_types()[section]
        docs = field_docs(cls)
        current = getattr(defaults, section)
        fields = []
        for fname, tp in field_types(cls).items():
            default = getattr(current, fname)
            shown = "null" if default is None else yaml.safe_dump(
                default, default_flow_style=True).strip().removesuffix("...").strip()
            fields.append(FieldDoc(fname, type_name(tp), shown, docs.get(fname, "")))
        out.append((section, inspect.cleandoc(cls.__doc__ or ""), fields))
    return out


def describe_config(sections: Iterable[str] | None = None, width: int = 100) -> str:
    """Help text: every ``--section.field`` with its type, default and docstring."""
    lines: list[str] = []
    for section, doc, fields in documented_sections(sections):
        # The section's docstring, one wrapped paragraph after another, under its name.
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        lines.extend(textwrap.wrap(f"{section}:  {paragraphs[0]}", width=width,
                                   subsequent_indent=" " * 2) or [f"{section}:"])
        for para in paragraphs[1:]:
            lines.extend(textwrap.wrap(para, width=width, initial_indent=" " * 2,
                                       subsequent_indent=" " * 2))
        for f in fields:
            lines.append(f"  --{section}.{f.name}  ({f.type}; default {f.default})")
            for para in f.doc.split("\n\n"):  # re-flowed paragraph by paragraph
                lines.extend(textwrap.wrap(" ".join(para.split()), width=width,
                                           initial_indent=" " * 6, subsequent_indent=" " * 6))
        lines.append("")
    return "\n".join(lines)


def config_from_argv(argv: Sequence[str], world_size: int | None = None) -> TrainConfig:
    """The config ``gspo-train argv`` runs: ``parse_cli`` + ``load_config`` of the ``--config``
    recipe or, without one, ``DEMO_RECIPE`` (+ ``validate_config`` when ``world_size`` is given)."""
    path, overrides = parse_cli(argv)
    cfg = load_config(DEMO_RECIPE if path is None else path, overrides)
    if world_size is not None:
        validate_config(cfg, world_size)
    return cfg
