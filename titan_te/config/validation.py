"""Validating a config: every value against its option's rules, every combination, and the rules of the
chosen components (a model family's `check`, an optimizer's `reads` and options), all before any heavy work."""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import traceback
from typing import Any

from titan_te.config.schema import (MISSING_VALUE, Config, Parallelism, _closest, _coerce, _fields, _registry,
                                    _registry_fields, _type_of, bare_flag, number, refinements, sections)
from titan_te.errors import ConfigError
from titan_te.paths import RUN_FOLDER_ROOM, check_path


def _check_fp8_head(cfg, where: str) -> None:
    from titan_te.models import MODELS

    ask = f"fp8.head = '{cfg.fp8.head}'"
    if not MODELS.get(cfg.model.name).fp8_head:
        raise ConfigError(f"{ask}: model {cfg.model.name} has no FP8 output head; set --fp8.head=off {where}")
    if not cfg.model.fused_loss:
        raise ConfigError(f"{ask} runs inside the fused head, which model.fused_loss = false turns off {where}")


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not a number of processes >= 1")
    return int(raw)


def _custom_import(module: str, where: str) -> None:
    """Import the user's module; what it raises is the user's to fix: one line naming file and line."""
    try:
        importlib.import_module(module)
    except SyntaxError as e:
        raise ConfigError(f"job.custom_import: {e.filename}:{e.lineno}: SyntaxError: {e.msg} {where}") from None
    except ImportError as e:
        raise ConfigError(f"job.custom_import: cannot import '{module}': {e} {where}") from None
    except Exception as e:  # noqa: BLE001 -- the user's module raised while importing: reported, exit 2
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise ConfigError(f"job.custom_import: importing '{module}' raised {type(e).__name__}: {e} "
                          f"({frame.filename}:{frame.lineno}) {where}") from None


def _check_job_name(name: str, where: str) -> None:
    """The run folder must be one folder inside job.dump_folder, never the dump folder or outside it."""
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ConfigError(f"job.name = {name!r} must be a plain folder name (no '/', not empty, '.' or '..'): "
                          f"the run folder is <job.dump_folder>/<job.name> {where}")


def _component_spec(section: str, name: str):
    """The registry entry `name` of one of the section's registries (e.g. OPTIMIZERS for [optimizer]), or None."""
    for spec in _registry_fields(sections()[section]):
        reg = _registry(spec)
        if name in reg:
            return reg.get(name)
    return None


def component_options(cfg: Config, section: str, name: str, where: str = ""):
    """The options object of the registered component `name` of [section] (its spec's `options`
    dataclass, defaults overridden by [section.<name>]), or None when it declares none."""
    spec = _component_spec(section, name)
    cls = getattr(spec, "options", None)
    if cls is None:
        return None
    out = cls()
    flds = _fields(cls)
    for key, (value, set_where) in cfg.components.get(f"{section}.{name}", {}).items():
        if key not in flds:
            raise ConfigError(f"unknown key {section}.{name}.{key}{_closest(key, list(flds))}; {name}'s options: "
                              f"{', '.join(flds)} ({set_where})")
        tp, dotted = _type_of(cls, key), f"{section}.{name}.{key}"
        if value is MISSING_VALUE:
            value = bare_flag(tp, dotted, getattr(out, key), set_where)
        setattr(out, key, _coerce(value, tp, dotted, set_where))
    for key, f in flds.items():
        _check_field(f"{section}.{name}.{key}", f, getattr(out, key), where)
    problem = out.check() if hasattr(out, "check") else ""
    if problem:
        raise ConfigError(f"[{section}.{name}]: {problem} {where}")
    return out


def _check_components(cfg: Config, where: str) -> None:
    for dotted in cfg.components:
        section, name = dotted.split(".", 1)
        spec = _component_spec(section, name)
        if spec is None:
            names = [n for r in _registry_fields(sections()[section]) for n in _registry(r).names()]
            raise ConfigError(f"[{dotted}]: no registered component of [{section}] is named {name!r}"
                              f"{_closest(name, names)} {where}")
        if getattr(spec, "options", None) is None:
            raise ConfigError(f"[{dotted}]: {name} declares no options of its own {where}")
        component_options(cfg, section, name, where)


def validate(cfg: Config, source: str, hardware: bool = True) -> None:
    """Check every value and every combination; all errors surface here, before heavy work."""
    where = f"(in {source} or the command line)"
    if cfg.job.custom_import:
        _custom_import(cfg.job.custom_import, where)
    _check_job_name(cfg.job.name, where)
    for section, cls in sections().items():
        body = getattr(cfg, section)
        for name, f in _fields(cls).items():
            value = getattr(body, name)
            key = f"{section}.{name}"
            if f.metadata.get("choices") and value not in f.metadata["choices"]:
                raise ConfigError(f"{key} = {value!r} is not one of {', '.join(f.metadata['choices'])}"
                                  f"{_closest(str(value), list(f.metadata['choices']))} {where}")
            if f.metadata.get("registry"):
                reg = _registry(f.metadata["registry"])
                for item in value if isinstance(value, list) else [value]:
                    if item not in reg and not (key == "model.backend" and item == "auto"):
                        raise ConfigError(f"{key}: {reg.miss_message(str(item))} {where}")
    _check_values(cfg, where)
    _check_components(cfg, where)
    _check_read_options(cfg)
    if hardware:
        from titan_te.hardware import check_hardware  # local import: keeps config light

        check_hardware(cfg, where)


CLI = "on the command line"


def _choosers(section: str) -> list[tuple[str, Any]]:
    """(option, registry) of each option of [section] that picks a registered component (optimizer.name,
    data.dataset, data.tokenizer, fp8.recipe ...)."""
    return [(name, _registry(f.metadata["registry"])) for name, f in _fields(sections()[section]).items()
            if f.metadata.get("registry")]


def _owned(registry) -> set[str]:
    """The options its components say they read: each is read only by the components that list it. An option
    no component lists (data.num_workers) is read whatever is chosen, as is every option by a component that
    lists none (no `reads`)."""
    return {key for name in registry.names() for key in (getattr(registry.get(name), "reads", None) or ())}


def _reads(spec, registry) -> set[str]:
    """The options of `registry`'s own that a component reads (all of them when it does not say)."""
    reads = getattr(spec, "reads", None)
    return _owned(registry) if reads is None else set(reads)


def readers(section: str, key: str) -> list[str] | None:
    """The registered components that read option `key` of [section]; None when every choice reads it."""
    for _, reg in _choosers(section):
        if key in _owned(reg):
            return [n for n in reg.names() if key in _reads(reg.get(n), reg)]
    return None


def _default(section_cls: type, key: str) -> Any:
    f = _fields(section_cls)[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _check_read_options(cfg: Config) -> None:
    """An option that the chosen component does not read is a mistake that would go unnoticed
    (--optimizer.beta1 with sgd; data.path with the embedded dataset trains on the embedded corpus). Refused
    when typed on the command line, or set in the file to other than its default unless the command line chose
    the component (a preset's options stay for the preset's own choice when the command line picks another)."""
    for section, cls in sections().items():
        body = getattr(cfg, section)
        for chooser, reg in _choosers(section):
            name = getattr(body, chooser)
            spec = reg.get(name) if isinstance(name, str) and name in reg else None
            reads = getattr(spec, "reads", None)
            if reads is None:
                continue
            for key in sorted(_owned(reg) - set(reads)):
                set_where = cfg.origins.get(f"{section}.{key}")
                if set_where is None or (set_where != CLI and (cfg.origins.get(f"{section}.{chooser}") == CLI
                                                                 or getattr(body, key) == _default(cls, key))):
                    continue
                own = f"; its own options: [{section}.{name}]" if getattr(spec, "options", None) else ""
                what = (", ".join(f"{section}.{r}" for r in reads)
                        or f"none of the options that depend on {section}.{chooser}")
                raise ConfigError(f"{section}.{key} is not an option of {name}, which reads {what}{own}; "
                                  f"{section}.{key} is for {', '.join(readers(section, key) or [])}: choose one with "
                                  f"{section}.{chooser}, or leave {section}.{key} out ({set_where})")


def _check_field(key: str, f: dataclasses.Field, value: Any, where: str) -> None:
    """A value within its option's choices and bounds; no float option takes NaN or inf; a path the OS
    can take."""
    if f.metadata.get("path") and isinstance(value, str):
        if not value and f.default:  # e.g. --job.dump_folder=$DIR with DIR unset: not the current directory
            raise ConfigError(f"{key} is empty; it names a folder (default {f.default!r}) {where}")
        check_path(key, value, where)
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(f.metadata['choices'])}"
                          f"{_closest(str(value), list(f.metadata['choices']))} {where}")
    b = f.metadata.get("bounds")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value} {where}")
    if b is not None and not b.holds(value):
        raise ConfigError(f"{key} must be {b.text()}, got {number(value)} {where}")


def _check_bounds(cfg: Config, where: str) -> None:
    """Every value within its option's bounds (no float option takes NaN or inf, every path one the OS
    can take); the folders inside the run folder with room for the files the run writes there."""
    for section, cls in sections().items():
        body = getattr(cfg, section)
        for name, f in _fields(cls).items():
            _check_field(f"{section}.{name}", f, getattr(body, name), where)
    check_path("job.dump_folder / job.name", str(cfg.run_folder), where, RUN_FOLDER_ROOM)
    for section, cls in sections().items():
        for name, f in _fields(cls).items():
            if f.metadata.get("path") == "run":
                check_path(f"{section}.{name}", str(cfg.run_folder / getattr(getattr(cfg, section), name)), where,
                           RUN_FOLDER_ROOM)


def _shown(value: Any, cli: bool = False) -> str:
    """A value as a message shows it: TOML's true / false, a string quoted (bare after a command-line flag)."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if cli else repr(value)


def _check_refinements(cfg: Config, where: str) -> None:
    """An option that refines an on/off option (`refines`, e.g. fp8.params of fp8.enable) set away from its
    default while that option is off would do nothing: refused. (A file's refinements of an option that the
    command line turned off are back at their defaults by now: loading.build.)"""
    for section, cls, key, switch in refinements():
        body, default = getattr(cfg, section), _default(cls, key)
        if not getattr(body, switch) and getattr(body, key) != default:
            raise ConfigError(f"{section}.{key} = {_shown(getattr(body, key))} needs {section}.{switch} = true; set "
                              f"--{section}.{switch}=true, or --{section}.{key}={_shown(default, True)} {where}")


def _check_values(cfg: Config, where: str) -> None:
    t = cfg.training
    _check_bounds(cfg, where)
    for step in cfg.profiling.memory_snapshot_steps:
        if step < 1:
            raise ConfigError(f"profiling.memory_snapshot_steps holds step numbers >= 1, got {step!r} {where}")
    _check_refinements(cfg, where)
    if cfg.fp8.attention:
        from titan_te.te.recipes import RECIPES

        if RECIPES.get(cfg.fp8.recipe).fp8_attention is None:
            able = ", ".join(n for n in RECIPES.names() if RECIPES.get(n).fp8_attention is not None)
            raise ConfigError(f"fp8.attention: the {cfg.fp8.recipe} recipe has no FP8 attention; recipes "
                              f"with it: {able} {where}")

    if cfg.model.wgrad_dtype != "float32":
        _check_wgrad_dtype(cfg, where)

    from titan_te.models import MODELS

    flavors = MODELS.get(cfg.model.name).flavors
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"model.flavor = '{cfg.model.flavor}' is not a flavor of {cfg.model.name}"
                          f"{_closest(cfg.model.flavor, list(flavors))}; valid: {', '.join(flavors)} {where}")
    _check_block_indices(cfg, getattr(flavors[cfg.model.flavor], "n_layers", None), where)
    if cfg.fp8.head != "off":
        _check_fp8_head(cfg, where)
    problem = MODELS.get(cfg.model.name).check(cfg) if MODELS.get(cfg.model.name).check else ""
    if problem:
        raise ConfigError(f"{problem} {where}")

    world = world_size_from_env()
    p = cfg.parallelism
    dp = dp_degrees(p, world, where)
    per_step = t.local_batch_size * dp[0] * dp[1]
    gbs = t.global_batch_size if t.global_batch_size > 0 else per_step
    if t.global_batch_size == 0 or t.global_batch_size < -1:
        raise ConfigError(f"training.global_batch_size must be > 0 or -1, got {t.global_batch_size} {where}")
    if gbs % per_step:
        raise ConfigError(f"training.global_batch_size = {gbs} is not divisible by local_batch_size x "
                          f"data-parallel degree = {t.local_batch_size} x {dp[0] * dp[1]} = {per_step} {where}")
    if cfg.checkpoint.load_step == 0 or cfg.checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be a step >= 1, or -1 for the newest checkpoint, got "
                          f"{cfg.checkpoint.load_step} {where}")
    if cfg.checkpoint.load_step != -1 and not cfg.checkpoint.enable:  # it would train from step 1, silently
        raise ConfigError(f"checkpoint.load_step = {cfg.checkpoint.load_step} resumes a checkpoint, which needs "
                          f"checkpoint.enable = true; set --checkpoint.enable=true, or leave load_step out {where}")


def _check_wgrad_dtype(cfg: Config, where: str) -> None:
    """model.wgrad_dtype is the dtype of TE's in-place weight gradients: they must be on, and the optimizer must
    read gradients of another dtype than their FP32 weights."""
    ask = f"model.wgrad_dtype = '{cfg.model.wgrad_dtype}'"
    if not cfg.model.fuse_wgrad_accumulation:
        raise ConfigError(f"{ask} is the dtype of TE's in-place weight gradients, which model.fuse_wgrad_accumulation "
                          f"= false turns off {where}")
    registry = _registry("titan_te.optim:OPTIMIZERS")
    if not registry.get(cfg.optimizer.name).reads_low_precision_grads:
        able = ", ".join(n for n in registry.names() if registry.get(n).reads_low_precision_grads)
        raise ConfigError(f"{ask}: optimizer {cfg.optimizer.name} does not read bf16 gradients of FP32 weights; "
                          f"optimizers that do: {able} {where}")


def _check_block_indices(cfg: Config, flavor_layers: int | None, where: str) -> None:
    """fp8.bf16_layers names blocks of this model: -n_layers <= index < n_layers (an index past the end
    would otherwise wrap around onto another block)."""
    n = cfg.model.n_layers or flavor_layers
    if not n:
        return
    outside = [i for i in cfg.fp8.bf16_layers if not -n <= i < n]
    if outside:
        raise ConfigError(f"fp8.bf16_layers = {cfg.fp8.bf16_layers}: {outside[0]} is not a block of this model; "
                          f"it has {n} blocks, indices 0 to {n - 1} (or -{n} to -1 from the end) {where}")


def dp_degrees(p: Parallelism, world: int, where: str = "") -> tuple[int, int]:
    """(replicate, shard) degrees of the data-parallel mesh for `world` ranks."""
    rep = p.data_parallel_replicate_degree
    if rep < 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree must be >= 1, got {rep} {where}")
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world % rep:
            raise ConfigError(f"world size {world} is not divisible by parallelism.data_parallel_replicate_degree"
                              f" = {rep} {where}")
        shard = world // rep
    if shard < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree must be >= 1 or -1, got {shard} {where}")
    if rep * shard != world:
        raise ConfigError(f"parallelism: replicate x shard degree = {rep} x {shard} must equal the world size "
                          f"{world} {where}")
    registry = _registry("titan_te.parallel:PARALLELISMS")
    spec = registry.get(p.data_parallel)
    if not spec.multi_process and world > 1:
        multi = ", ".join(n for n in registry.names() if registry.get(n).multi_process)
        raise ConfigError(f"parallelism.data_parallel = '{p.data_parallel}' runs on one process, but the world size "
                          f"is {world}; use {multi} {where}")
    if not spec.replicates and rep > 1:
        takes = " or ".join(f"'{n}'" for n in registry.names() if registry.get(n).replicates)
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = {rep} needs data_parallel = {takes} {where}")
    return rep, shard
