"""Loading a config: the command line (`--config FILE`, `--section.key=value`), the TOML file, the
overrides on top, typed as the schema says. Precedence: CLI > TOML > defaults."""
from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_te.config.schema import (MISSING_VALUE, Config, _closest, _coerce, _fields, _registry_fields, _type_of,
                                    bare_flag, refinements, sections)
from titan_te.config.validation import CLI, _default, validate
from titan_te.errors import ConfigError


def _unknown_key_hint(section: str, key: str, secs: dict, cli: bool) -> str:
    """Did-you-mean for an unknown key: the same key in another section, else the closest key here."""
    dash = "--" if cli else ""
    elsewhere = [s for s, cls in secs.items() if s != section and key in _fields(cls)]
    if elsewhere:
        return f" (did you mean '{dash}{elsewhere[0]}.{key}'? [{section}] has no '{key}')"
    close = difflib.get_close_matches(key, list(_fields(secs[section])), n=1, cutoff=0.5)
    return f" (did you mean '{dash}{section}.{close[0]}'?)" if close else ""


def _set_component(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    """[section.<component>] / --section.<component>.<key>: kept as set, typed once the component's
    registry (custom imports included) is known."""
    if isinstance(value, dict):  # a TOML table [optimizer.sgd]
        for k, v in value.items():
            _set_component(cfg, section, f"{key}.{k}", v, where)
        return
    comp, _, sub = key.partition(".")
    if not sub or "." in sub:
        raise ConfigError(f"'{section}.{key}': a component's option is {section}.<component>.<key> ({where})")
    if not _registry_fields(sections()[section]):
        raise ConfigError(f"unknown key {section}.{key}: [{section}] has no components with options ({where})")
    cfg.components.setdefault(f"{section}.{comp}", {})[sub] = (value, where)


def _set(cfg: Config, dotted: str, value: Any, where: str) -> None:
    cli = where == CLI
    if "." not in dotted:
        raise ConfigError(f"'{dotted}' is not of the form section.key ({where})")
    section, key = dotted.split(".", 1)
    secs = sections()
    if section not in secs:
        raise ConfigError(f"unknown section [{section}]{_closest(section, list(secs))} ({where})")
    flds = _fields(secs[section])
    if "." in key or (isinstance(value, dict) and key not in flds):
        _set_component(cfg, section, key, value, where)
        return
    if key not in flds:
        raise ConfigError(f"unknown key {section}.{key}{_unknown_key_hint(section, key, secs, cli)} ({where})")
    tp = _type_of(secs[section], key)
    if value is MISSING_VALUE:
        value = bare_flag(tp, f"{section}.{key}", getattr(getattr(cfg, section), key), where)
    setattr(getattr(cfg, section), key, _coerce(value, tp, f"{section}.{key}", where))
    cfg.origins[f"{section}.{key}"] = where


@dataclass
class CliArgs:
    config_file: str | None = None
    overrides: list[tuple[str, str]] = field(default_factory=list)
    help: bool = False
    print_config: bool = False


def parse_argv(argv: list[str]) -> CliArgs:
    args = CliArgs()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help"):
            args.help = True
        elif tok == "--print-config":
            args.print_config = True
        elif tok == "--config" or tok.startswith("--config="):
            if "=" in tok:
                args.config_file = tok.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                args.config_file = argv[i]
            else:
                raise ConfigError("--config needs a file name")
        elif tok.startswith("--") and len(tok) > 2:
            body = tok[2:]
            if "=" in body:
                key, value = body.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                key, value = body, argv[i + 1]
                i += 1
            else:  # a bare flag: only valid for booleans
                key, value = body, MISSING_VALUE
            args.overrides.append((key, value))
        else:
            raise ConfigError(f"unexpected argument '{tok}'; options look like --section.key=value")
        i += 1
    return args


PRESETS = Path(__file__).resolve().parents[2] / "train_configs"


def presets() -> list[str]:
    return sorted(p.name for p in PRESETS.glob("*.toml")) if PRESETS.is_dir() else []


def resolve_config_path(name: str) -> Path:
    """A path as given; else a bare name (with or without .toml) from train_configs/."""
    p = Path(name)
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"--config {name} is a folder, not a TOML file; presets: {', '.join(presets())}")
    if len(p.parts) == 1:
        for candidate in (PRESETS / name, PRESETS / f"{name}.toml"):
            if candidate.is_file():
                return candidate
    raise ConfigError(f"config file not found: {name} (not a file here, nor a preset in {PRESETS}); presets: "
                      f"{', '.join(presets()) or 'none'}")


def load_toml(path: str) -> dict:
    p = resolve_config_path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error in {p}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None


def build(toml_data: dict, overrides: list[tuple[str, str]], source: str = "<defaults>") -> Config:
    cfg = Config()
    for section, body in toml_data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"top-level key '{section}' must be a [section] table (in {source})")
        for key, value in body.items():
            _set(cfg, f"{section}.{key}", value, f"in {source}")
    for key, value in overrides:
        _set(cfg, key, value, CLI)
    _switched_off(cfg)
    return cfg


def _switched_off(cfg: Config) -> None:
    """A file's refinements of an on/off option (`refines`, e.g. the FP8 presets' fp8.head and fp8.params) are
    for the file's own setting: when the command line turns that option off they go back to their defaults, so
    `--fp8.enable=false` alone trains an FP8 preset without FP8. One typed on the command line stays (and is
    checked against the switch)."""
    for section, cls, key, switch in refinements():
        body = getattr(cfg, section)
        if (cfg.origins.get(f"{section}.{switch}") == CLI and not getattr(body, switch)
                and cfg.origins.get(f"{section}.{key}") not in (None, CLI)):
            setattr(body, key, _default(cls, key))
            del cfg.origins[f"{section}.{key}"]


def load(argv: list[str], hardware: bool = True) -> tuple[Config, CliArgs]:
    """Parse argv, read the TOML file, apply overrides and validate (`hardware`: also against this
    machine's GPU and packages). Raises ConfigError."""
    args = parse_argv(argv)
    data = load_toml(args.config_file) if args.config_file else {}
    cfg = build(data, args.overrides, args.config_file or "<defaults>")
    if not args.help:
        validate(cfg, args.config_file or "<defaults>", hardware)
    return cfg, args
