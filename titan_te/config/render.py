"""Rendering a config: `--help` (every option with its type, default, doc and who reads it) and the
resolved TOML (`--print-config`, the run folder's config.toml)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from titan_te.config.schema import Config, _fields, _registry, _registry_fields, _type_name, _type_of, sections
from titan_te.config.validation import component_options, readers


def help_text(cfg: Config | None = None, source: str = "") -> str:
    """The options with their defaults; with the config of `--config FILE`, also the value it sets."""
    lines = [
        "usage: train.py [--config FILE] [--print-config] [--section.key=value | --section.key value]...",
        "",
        "Options from the TOML file can be overridden on the command line (CLI > TOML > defaults).",
        "Lists are comma-separated; booleans are true/false.",
    ]
    for section, cls in sections().items():
        lines.append(f"\n[{section}]")
        for name, f in _fields(cls).items():
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            tp = _type_name(_type_of(cls, name))
            value = getattr(getattr(cfg, section), name) if cfg is not None else default
            here = f", {source}: {_toml_value(value)}" if cfg is not None and value != default else ""
            lines.append(f"  --{section}.{name} ({tp}, default {_toml_value(default)}{here})")
            lines.append(f"      {f.metadata['doc']}")
            readers_of = readers(section, name)
            if readers_of is not None:
                lines.append(f"      read by: {', '.join(readers_of) or 'none'}")
            if f.metadata.get("registry"):  # what is registered now, custom imports included
                lines.append(f"      registered: {', '.join(_registry(f.metadata['registry']).names())}")
        for reg in _registry_fields(cls):  # the own options of registered components: [section.<name>]
            for comp in _registry(reg).names():
                opts = getattr(_registry(reg).get(comp), "options", None)
                for name, f in (_fields(opts).items() if opts else ()):
                    lines.append(f"  --{section}.{comp}.{name} ({_type_name(_type_of(opts, name))}, default "
                                 f"{_toml_value(f.default)}; with {section} {comp})")
                    lines.append(f"      {f.metadata['doc']}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # JSON's string escapes are TOML's (control characters as \\uXXXX); DEL too
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def to_toml(cfg: Config) -> str:
    out = []
    for section in sections():
        out.append(f"[{section}]")
        body = getattr(cfg, section)
        for f in dataclasses.fields(body):
            out.append(f"{f.name} = {_toml_value(getattr(body, f.name))}")
        out.append("")
    for dotted, values in cfg.components.items():  # the keys as set, typed (validation has run)
        opts = component_options(cfg, *dotted.split(".", 1))
        out.append(f"[{dotted}]")
        out += [f"{key} = {_toml_value(getattr(opts, key))}" for key in values]
        out.append("")
    return "\n".join(out)
