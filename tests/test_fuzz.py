"""Random input of every shape where a user or a damaged file hands us values: each case is loaded, or
refused with the package's own error (one line for the user), never another exception (a traceback).

Seeded, so a failure names its case and repeats. Found this way: a nested list in
checkpoint.exclude_from_loading (TypeError in the registry lookup), fp8.bf16_layers past the model's
blocks (silently wrapped onto another block), manifests whose facts or parts had other types (TypeError
tracebacks in the resume).
"""
import copy
import datetime
import json
import random

import pytest

VALUES = [0, -1, 1, 2, 3, 7, 4096, 10**30, -10**30, 0.0, 0.5, -1.5, 1e-300, float("nan"), float("inf"), True, False,
          "", "x", "1,2", "none", "fsdp", "hsdp", "full", "every_n", "bfloat16", "delayed", "cosine", "8B", "debug",
          "/dev/null", "~", [], [1], [-1, 0], ["a", "b"], [[1]], [{"a": 1}], [True], {}, {"a": 1},
          datetime.date(2020, 1, 1), datetime.time(1, 2)]
TEXTS = ["", "0", "-1", "1", "3", "nan", "inf", "1e400", "0.5", "true", "false", "True", "[]", "1,2", ",", "a,b,",
         "99999999999999999999999", "0x10", "1_000", "é", "fsdp", "llama3", "8B", "debug", "full", "delayed",
         "bfloat16", "../x", "/nonexistent/x", " 1", "+1", "=", "a=b", "-2.5", "0,-1"]
PRESETS = ["debug", "llama_fp8", "llama3_1b_fp8", "llama_bf16"]


def _keys():
    """Every option: the sections' and the registered components' own ([optimizer.sgd] ...)."""
    from titan_te.config.schema import _fields, _registry, _registry_fields, sections

    keys = [(s, k) for s, cls in sections().items() for k in _fields(cls)]
    for section, cls in sections().items():
        for registry in _registry_fields(cls):
            reg = _registry(registry)
            keys += [(section, f"{name}.{k}") for name in reg.names() if getattr(reg.get(name), "options", None)
                     for k in _fields(reg.get(name).options)]
    return keys


def _loads_or_config_error(load, case: str) -> None:
    """load() returns, or raises the package's ConfigError with one line; anything else fails, naming the case."""
    from titan_te.errors import ConfigError

    try:
        load()
    except ConfigError as e:
        assert "\n" not in e.msg, (case, e.msg)
    except Exception as e:
        raise AssertionError(case) from e


def _from_toml(data: dict, name: str):
    from titan_te.config.loading import build
    from titan_te.config.validation import validate

    return lambda: validate(build(data, [], name), name, False)


def _from_argv(argv: list[str]):
    from titan_te import config as config_mod

    return lambda: config_mod.load(argv, hardware=False)


def test_every_toml_value_for_every_option_loads_or_is_a_config_error(monkeypatch):
    """Each option set alone to each value (every pair, no sampling), over the FP8 preset (the most rules)."""
    from titan_te.config.loading import load_toml

    preset = "llama_fp8"
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = load_toml(preset)
    for section, key in _keys():
        for value in VALUES:
            data = {s: dict(body) for s, body in base.items()}
            data.setdefault(section, {})[key] = value
            _loads_or_config_error(_from_toml(data, preset), f"{preset} with {section}.{key} = {value!r}")


@pytest.mark.parametrize("seed", range(4))
def test_any_toml_values_for_several_options_load_or_are_a_config_error(seed, monkeypatch):
    from titan_te.config.loading import load_toml

    monkeypatch.setenv("WORLD_SIZE", "1")
    rng, keys = random.Random(seed), _keys()
    presets = {p: load_toml(p) for p in PRESETS}
    for case in range(300):
        name = rng.choice(PRESETS)
        data = {s: dict(body) for s, body in presets[name].items()}
        changed = []
        for _ in range(rng.randint(1, 4)):
            section, key = rng.choice(keys)
            data.setdefault(section, {})[key] = value = rng.choice(VALUES)
            changed.append(f"{section}.{key}={value!r}")
        _loads_or_config_error(_from_toml(data, name), f"seed {seed} case {case}: {name} with {changed}")


def test_every_command_line_value_for_every_option_loads_or_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    for section, key in _keys():
        for text in TEXTS:
            argv = ["--config=llama_fp8", f"--{section}.{key}={text}"]
            _loads_or_config_error(_from_argv(argv), str(argv))


@pytest.mark.parametrize("seed", range(4))
def test_any_command_line_values_for_several_options_load_or_are_a_config_error(seed, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    rng, keys = random.Random(seed), _keys()
    for case in range(300):
        argv = [f"--config={rng.choice(PRESETS)}"] if rng.random() < 0.7 else []
        argv += [f"--{s}.{k}" + ("" if rng.random() < 0.1 else f"={rng.choice(TEXTS)}")  # some bare flags
                 for s, k in (rng.choice(keys) for _ in range(rng.randint(1, 4)))]
        _loads_or_config_error(_from_argv(argv), f"seed {seed} case {case}: {argv}")


MANIFEST = {"dp_world": 1, "files": {"__0_0.distcp": [100, 12345], ".metadata": [10, 678]}, "format": 1,
            "lineage": "0123456789ab", "model_only": False, "parts": ["model", "optimizer", "train_state"],
            "run_folder": "/runs/debug", "saved_at": 1.5, "step": 4,
            "facts": {"model": {"name": "llama3", "n_layers": 4}, "optimizer": {"name": "adamw"},
                      "settings": {"training.steps": 4}, "export": {"seq_len": 32, "bos_id": 256}}}


def _mutate(rng, manifest: dict) -> dict:
    out = copy.deepcopy(manifest)
    for _ in range(rng.randint(1, 3)):
        target = out
        key = rng.choice(list(target))
        while isinstance(target[key], dict) and target[key] and rng.random() < 0.6:
            target = target[key]
            key = rng.choice(list(target))
        if rng.random() < 0.2:
            del target[key]
        else:
            target[key] = rng.choice(VALUES[:-2])  # JSON has no dates
    return out


def test_a_mutated_manifest_reads_as_ours_with_our_types_or_not_at_all(tmp_path):
    """Everything the resume and export read of a manifest has the type this package writes, or the
    manifest is not ours (Manifest.read is None: the step is ignored with a warning, never loaded)."""
    from titan_te.checkpoint.folder import MANIFEST as NAME, Manifest

    (tmp_path / NAME).write_text(json.dumps(MANIFEST))
    assert Manifest.read(tmp_path) is not None  # the unmutated one is ours
    rng, accepted = random.Random(0), 0
    for case in range(2000):
        data = _mutate(rng, MANIFEST)
        (tmp_path / NAME).write_text(json.dumps(data))
        m = Manifest.read(tmp_path)
        if m is None:
            continue
        accepted += 1
        assert type(m.step) is int and type(m.dp_world) is int and m.dp_world >= 1 and type(m.model_only) is bool
        assert isinstance(m.lineage, str) and all(type(p) is str for p in m.parts), (case, data)
        assert all(isinstance(v, dict) for v in m.facts.values()), (case, data)
        assert all(len(v) == 2 and all(type(x) is int for x in v) for v in m.files.values()), (case, data)
    assert 100 < accepted < 2000  # both kinds were exercised
