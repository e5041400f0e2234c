"""Configuration: one dataclass per TOML section, loading, CLI overrides, validation and --help.

Precedence is CLI > TOML > defaults. Every mistake raises ConfigError *before* any model or data is
built; `train.py` turns it into `config error: ...` on stderr and exit code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import os
import traceback
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib


from titan_te.errors import ConfigError
from titan_te.paths import RUN_FOLDER_ROOM, check_path

@dataclass(frozen=True)
class Bounds:
    """The valid interval of a number option; `low_open` / `high_open` exclude the end itself."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, v: float) -> bool:
        return not ((self.low is not None and (v < self.low or (self.low_open and v == self.low))) or
                    (self.high is not None and (v > self.high or (self.high_open and v == self.high))))

    def text(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {number(self.low)}"
        return (f"within {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}"
                f"{')' if self.high_open else ']'}")


def number(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


POSITIVE, NON_NEGATIVE = Bounds(0, low_open=True), Bounds(0)
FRACTION, UNIT_OPEN = Bounds(0, 1), Bounds(0, 1, high_open=True)
WEEK_S = 7 * 24 * 3600


def opt(default: Any, doc: str, *, choices: tuple | None = None, registry: str | None = None,
        bounds: Bounds | None = None, path: str | None = None):
    """A config field with a default and a one-line doc.

    `choices` is a fixed set of values; `registry` names "module:ATTR" of a Registry whose names
    are the valid values (resolved lazily so custom imports can add entries first); `bounds` is the
    valid interval of a number (every float must also be finite: NaN and inf are never valid); `path`
    marks a file-system path: "run" for one inside the run folder unless absolute, "any" for others.
    """
    meta = {"doc": doc, "choices": choices, "registry": registry, "bounds": bounds, "path": path}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------
@dataclass
class Job:
    name: str = opt("debug", "run name; the run folder is <dump_folder>/<name>")
    dump_folder: str = opt("./outputs", "root folder for all runs", path="any")
    description: str = opt("", "free text shown in the startup summary")
    custom_import: str = opt("", "module to import first, e.g. to register your own model or dataset")


@dataclass
class Model:
    name: str = opt("llama3", "model family", registry="titan_te.models:MODELS")
    flavor: str = opt("debug", "size preset of the model family (debug, 1B, 3B, 8B, 70B for llama3)")
    backend: str = opt("auto", "layer backend: auto (te when CUDA and TE are present), torch or te",
                       registry="titan_te.layers:BACKENDS")
    n_layers: int = opt(0, "override the flavor's number of blocks (0 keeps the flavor's)", bounds=Bounds(0, 4096))
    document_mask: bool = opt(False, "attention stays inside each packed document (a document starts at the "
                                     "tokenizer's BOS); off: sequences attend across document boundaries")
    fused_loss: bool = opt(True, "models that offer it compute the output head and cross-entropy chunk by "
                                 "chunk, never holding the FP32 logits of the whole batch (false: full logits)")
    fuse_wgrad_accumulation: bool = opt(False, "te backend: accumulate weight gradients into param.main_grad "
                                               "(not supported: bypasses the data-parallel reduction)")


@dataclass
class Training:
    steps: int = opt(200, "optimizer steps to train", bounds=Bounds(1, 10**9))
    local_batch_size: int = opt(8, "sequences per micro-batch on each data-parallel rank", bounds=Bounds(1, 2**20))
    global_batch_size: int = opt(-1, "sequences per optimizer step over all ranks (-1: local x dp); "
                                     "gradient accumulation = global / (local x dp)")
    seq_len: int = opt(256, "tokens per sequence", bounds=Bounds(1, 2**22))
    max_norm: float = opt(1.0, "gradient-norm clipping threshold (0 disables clipping)", bounds=NON_NEGATIVE)
    seed: int = opt(0, "seed for weights, data order and dropout-free sampling", bounds=Bounds(0, 2**32 - 1))
    deterministic: bool = opt(False, "use deterministic algorithms (bit-exact reruns, slower)")
    device: str = opt("auto", "auto (cuda when available), cuda or cpu", choices=("auto", "cuda", "cpu"))
    mixed_precision_param: str = opt("bfloat16", "FSDP parameter dtype for compute on GPU (CPU uses float32)",
                                     choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "dtype of gradient reduction", choices=("float32", "bfloat16"))


@dataclass
class Data:
    dataset: str = opt("embedded", "dataset: embedded (Python's own source text, no download), files (text "
                                   "files tokenized at start), tokens (shards from titan_te.data.prepare), "
                                   "hf (a Hugging Face dataset, streamed)",
                       registry="titan_te.data:DATASETS")
    path: str = opt("", "files: a .txt/.jsonl/.json/.parquet file, folder or glob; tokens: the shard folder; "
                        "hf: the dataset name (or a builder such as json with hf_data_files)", path="any")
    tokenizer: str = opt("byte", "tokenizer: byte (no files), hf (tokenizer.json) or tiktoken (.model)",
                         registry="titan_te.data:TOKENIZERS")
    tokenizer_path: str = opt("", "the hf / tiktoken tokenizer file (or its folder)", path="any")
    text_field: str = opt("text", "field holding the text in .jsonl / .parquet records")
    num_workers: int = opt(0, "data-loader worker processes", bounds=Bounds(0, 256))
    shuffle: bool = opt(True, "shuffle sequences each epoch (seeded by training.seed)")
    hf_subset: str = opt("", "hf: the dataset's configuration (subset) name, if it has several")
    hf_split: str = opt("train", "hf: the split to stream")
    hf_data_files: str = opt("", "hf: data files (a path or glob) for builders such as json or parquet",
                             path="any")
    hf_shuffle_buffer: int = opt(10000, "hf: records in the shuffle buffer", bounds=Bounds(1, 10**8))


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate held-out data every `freq` steps (loss logged to console and TensorBoard)")
    freq: int = opt(100, "validate every N steps", bounds=Bounds(1))
    steps: int = opt(10, "batches per validation (per data-parallel rank)", bounds=Bounds(1))
    hold_out_fraction: float = opt(0.01, "share of the training tokens held out when the dataset has no "
                                         "validation split of its own (tokens shards bring val-*)", bounds=Bounds(0, 1, low_open=True, high_open=True))


@dataclass
class Parallelism:
    data_parallel: str = opt("fsdp", "data parallelism: fsdp, hsdp, ddp or none",
                             registry="titan_te.parallel:PARALLELISMS")
    data_parallel_shard_degree: int = opt(-1, "ranks a parameter is sharded over (-1: the rest of the world)")
    data_parallel_replicate_degree: int = opt(1, "replicas of the sharded model (hsdp)")
    reshard_after_forward: bool = opt(True, "free gathered parameters after forward (ZeRO-3); false is ZeRO-2")
    unsharded_one_rank: bool = opt(False, "fsdp / hsdp on a single rank: train without FSDP, under torch.autocast "
                                          "(no parameter and gradient copies; the README gives what it saves); "
                                          "checkpoints load into either layout; the FP8 presets set it")
    comm_timeout_s: int = opt(1800, "seconds a collective may wait for the other ranks before the run fails", bounds=Bounds(1, WEEK_S))
    rendezvous_timeout_s: int = opt(300, "seconds rank 0 waits at start-up for every rank (node) to join; then one "
                                         "line names the ones that did not", bounds=Bounds(1, WEEK_S))


@dataclass
class Optimizer:
    name: str = opt("adamw", "optimizer", registry="titan_te.optim:OPTIMIZERS")
    lr: float = opt(1e-3, "peak learning rate", bounds=POSITIVE)
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms, biases, 1-D params)", bounds=NON_NEGATIVE)
    beta1: float = opt(0.9, "Adam beta1", bounds=UNIT_OPEN)
    beta2: float = opt(0.95, "Adam beta2", bounds=UNIT_OPEN)
    eps: float = opt(1e-8, "Adam epsilon", bounds=NON_NEGATIVE)
    master_weights: bool = opt(True, "fused_adam / te_fused_adam: FP32 master copies of low-precision weights")
    moment_dtype: str = opt("float32", "fused_adam / te_fused_adam: dtype of exp_avg and exp_avg_sq",
                            choices=("float32", "bfloat16"))
    store_param_remainders: bool = opt(False, "fused_adam / te_fused_adam: keep only the 16 low bits of FP32 "
                                              "masters of BF16 params (saves memory)")
    triton: bool = opt(True, "fused_adam: FP8 weights (delayed scaling) with bf16 moments take one Triton kernel "
                             "that updates the master and writes the FP8 weight (false: TE's kernel, then a "
                             "re-quantization pass)")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(10, "linear warmup steps from lr/(warmup+1) to lr", bounds=NON_NEGATIVE)
    decay_type: str = opt("cosine", "decay after warmup: cosine, linear or constant",
                          registry="titan_te.optim:LR_DECAYS")
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak", bounds=FRACTION)


@dataclass
class Metrics:
    log_freq: int = opt(10, "print / log metrics every N steps", bounds=Bounds(1))
    enable_tensorboard: bool = opt(True, "write TensorBoard event files under <run>/tb")
    enable_jsonl: bool = opt(True, "write every logged value to <run>/metrics.jsonl, one JSON object per line "
                                   "(readable without TensorBoard)")
    rank_0_only: bool = opt(True, "only rank 0 writes TensorBoard events and the metrics file")
    fp8_stats_freq: int = opt(100, "with delayed-scaling FP8: log amax and scale statistics per layer group "
                                   "every N steps (0 disables)", bounds=NON_NEGATIVE)


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "write torch.profiler traces of steps profile_start .. +profile_active")
    profile_start: int = opt(5, "first traced step", bounds=Bounds(1))
    profile_active: int = opt(2, "number of traced steps", bounds=Bounds(1))
    traces_folder: str = opt("profile_traces", "trace folder inside the run folder (or an absolute path)",
                             path="run")
    enable_memory_snapshot: bool = opt(False, "record CUDA allocations; write a snapshot at "
                                              "memory_snapshot_steps and on out-of-memory")
    memory_snapshot_steps: list = opt([], "steps after which a CUDA memory snapshot is written")
    memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder inside the run folder (or an absolute "
                                                          "path)", path="run")
    memory_history_entries: int = opt(100000, "allocation events kept for the snapshot", bounds=Bounds(1))


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save DCP checkpoints and resume from the newest one")
    folder: str = opt("checkpoint", "checkpoint folder inside the run folder (or an absolute path)", path="run")
    interval: int = opt(500, "save every N steps (the last step is always saved)", bounds=Bounds(1))
    async_mode: str = opt("disabled", "disabled (training waits for the write), async (copy and write "
                                      "in the background) or async_with_pinned_mem (copy into reused pinned "
                                      "buffers)",
                          choices=("disabled", "async", "async_with_pinned_mem"))
    keep_latest_k: int = opt(0, "keep only the newest K checkpoints (0 keeps all)", bounds=NON_NEGATIVE)
    load_step: int = opt(-1, "step to resume from (-1: newest complete checkpoint)")
    replace_newer: bool = opt(False, "allow a resume that would make later saves replace newer checkpoints "
                                     "(an older load_step, or train_state excluded); they are moved to "
                                     "<folder>/superseded-<time>/, never deleted")
    resume_other_run: bool = opt(False, "resume from a checkpoint.folder outside this run folder whose newest "
                                        "checkpoint another run folder wrote: this run continues that run (its "
                                        "lineage, and keep_latest_k over its checkpoints)")
    allow_new_tokenizer: bool = opt(False, "resume a checkpoint trained with another tokenizer (kind, vocabulary or "
                                           "its size): its embedding rows then stand for other tokens")
    exclude_from_loading: list = opt([], "parts not restored on resume: model, optimizer, lr_scheduler, "
                                         "dataloader, train_state, rng, fp8",
                                     registry="titan_te.checkpoint.parts:PARTS")
    max_consecutive_failures: int = opt(2, "saves in a row that may fail for environmental reasons (disk full, "
                                           "I/O, permission) before the run stops with exit code 3", bounds=NON_NEGATIVE)
    write_threads: int = opt(2, "threads per rank writing checkpoint files", bounds=Bounds(1, 64))
    verify_checksums: bool = opt(True, "before a resume, check every checkpoint file against the checksum recorded "
                                       "when it was saved (a damaged or swapped file is named, not loaded)")
    skip_space_check: bool = opt(False, "train even when one checkpoint of this run does not fit the free space of "
                                        "checkpoint.folder (checked at start-up)")
    initial_load_path: str = opt("", "Hugging Face Llama folder (safetensors) to start from when the run "
                                     "has no checkpoint yet (fine-tuning)", path="any")
    last_save_model_only: bool = opt(False, "the final save holds only the model weights (in export_dtype)")
    export_dtype: str = opt("float32", "dtype of model-only saves", choices=("float32", "bfloat16"))


@dataclass
class FP8:
    enable: bool = opt(False, "run linear layers in FP8 (te backend, needs an sm_89+ GPU)")
    recipe: str = opt("delayed", "delayed, current, block, mxfp8 or nvfp4 (the last two need Blackwell)",
                      registry="titan_te.fp8:RECIPES")
    fp8_format: str = opt("HYBRID", "HYBRID (E4M3 forward, E5M2 gradients) or E4M3", choices=("HYBRID", "E4M3"))
    amax_history_len: int = opt(1024, "delayed scaling: amax history length", bounds=Bounds(1, 2**16))
    amax_compute_algo: str = opt("max", "delayed scaling: max or most_recent", choices=("max", "most_recent"))
    margin: int = opt(0, "delayed scaling: margin (power of two) for the scaling factor", bounds=Bounds(0, 64))
    params: bool = opt(False, "keep weights in FP8 (te.quantized_model_init): FSDP2 all-gathers FP8 bytes; "
                              "needs an optimizer with FP32 master weights")
    preserve_high_precision_init: bool = opt(True, "fused_adam: seed the FP32 master weights from the "
                                                   "pre-quantization init values")
    bf16_layers: list = opt([], "block indices kept in bf16 (negative counts from the end), e.g. [0, -1]")
    attention: bool = opt(False, "also run attention in FP8 (TE's fp8_dpa through cuDNN; delayed or current "
                                 "scaling): faster, slightly less exact")
    head: str = opt("off", "the fused output head in FP8 (current per-tensor scaling): dgrad = the gradient into "
                           "the model (e5m2 x e4m3), all = the logits too; off = bf16 (torchtitan's and "
                           "Megatron's default); its weight gradient stays bf16", choices=("off", "dgrad", "all"))


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "none, full (every block) or every_n (every N-th block)",
                    choices=("none", "full", "every_n"))
    every_n: int = opt(2, "with mode=every_n: checkpoint one block out of N", bounds=Bounds(1))


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each block (eager TE modules stay eager)")


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fp8: FP8 = field(default_factory=FP8)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)

    @property
    def run_folder(self) -> Path:
        return Path(self.job.dump_folder) / self.job.name
    # the own options of registered components, as set: "optimizer.sgd" -> {key: (value, where it was set)};
    # typed and checked against the component's options dataclass by component_options()
    components: dict = field(default_factory=dict)
    # where each option that is not a default was set: "optimizer.lr" -> "on the command line" / "in FILE"
    origins: dict = field(default_factory=dict)

    def settings(self) -> dict:
        """Every option as "section.key" -> value (what a checkpoint records to say later what changed)."""
        return {f"{section}.{f.name}": getattr(getattr(self, section), f.name)
                for section in sections() for f in dataclasses.fields(getattr(self, section))}


# ---------------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------------
def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
            if dataclasses.is_dataclass(f.default_factory)}


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _type_of(section_cls: type, name: str) -> type:
    return typing.get_type_hints(section_cls)[name]


def _type_name(tp: type) -> str:
    return {list: "list", bool: "bool", int: "int", float: "float", str: "str"}.get(tp, str(tp))


def _check_fp8_head(cfg, where: str) -> None:
    from titan_te.models import MODELS

    ask = f"fp8.head = '{cfg.fp8.head}'"
    if not cfg.fp8.enable:
        raise ConfigError(f"{ask} needs fp8.enable = true; or set --fp8.head=off {where}")
    if not MODELS.get(cfg.model.name).fp8_head:
        raise ConfigError(f"{ask}: model {cfg.model.name} has no FP8 output head; set --fp8.head=off {where}")
    if not cfg.model.fused_loss:
        raise ConfigError(f"{ask} runs inside the fused head, which model.fused_loss = false turns off {where}")


def _closest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value: Any, tp: type, key: str, where: str) -> Any:
    """Turn a TOML value or a CLI string into the field's type, or raise ConfigError."""
    bad = ConfigError(f"{key} expects {_type_name(tp)}, got {value!r} ({where})")
    if isinstance(value, str) and tp is not str and where == "on the command line":  # TOML values are typed
        text = value.strip()
        if tp is bool:  # exactly what the README and --help promise
            if text.lower() == "true":
                return True
            if text.lower() == "false":
                return False
            raise ConfigError(f"{key} expects true or false, got {value!r} ({where})")
        if tp is list:
            return [_list_item(v.strip()) for v in text.split(",") if v.strip()]
        try:
            return tp(text)
        except ValueError:
            raise bad from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):  # "dataloader,rng" in TOML reads as it does on the command line
            return [_list_item(v.strip()) for v in value.split(",") if v.strip()]
        raise bad
    if tp is str and isinstance(value, str):
        return value
    raise bad


def _list_item(text: str):
    try:
        return int(text)
    except ValueError:
        return text


MISSING_VALUE = object()  # a command-line option given without a value


def _unknown_key_hint(section: str, key: str, secs: dict, cli: bool) -> str:
    """Did-you-mean for an unknown key: the same key in another section, else the closest key here."""
    dash = "--" if cli else ""
    elsewhere = [s for s, cls in secs.items() if s != section and key in _fields(cls)]
    if elsewhere:
        return f" (did you mean '{dash}{elsewhere[0]}.{key}'? [{section}] has no '{key}')"
    close = difflib.get_close_matches(key, list(_fields(secs[section])), n=1, cutoff=0.5)
    return f" (did you mean '{dash}{section}.{close[0]}'?)" if close else ""


def _registry_fields(section_cls: type) -> list[str]:
    return [f.metadata["registry"] for f in _fields(section_cls).values() if f.metadata.get("registry")]


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
    cli = where == "on the command line"
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
        if tp is not bool:
            raise ConfigError(f"--{section}.{key} needs a value, e.g. --{section}.{key}="
                              f"{_toml_value(getattr(getattr(cfg, section), key))} ({where})")
        value = True
    setattr(getattr(cfg, section), key, _coerce(value, tp, f"{section}.{key}", where))
    cfg.origins[f"{section}.{key}"] = where


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
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


PRESETS = Path(__file__).resolve().parents[1] / "train_configs"


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
        _set(cfg, key, value, "on the command line")
    return cfg


def load(argv: list[str], hardware: bool = True) -> tuple[Config, CliArgs]:
    """Parse argv, read the TOML file, apply overrides and validate (`hardware`: also against this
    machine's GPU and packages). Raises ConfigError."""
    args = parse_argv(argv)
    data = load_toml(args.config_file) if args.config_file else {}
    cfg = build(data, args.overrides, args.config_file or "<defaults>")
    if not args.help:
        validate(cfg, args.config_file or "<defaults>", hardware)
    return cfg, args


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _registry(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


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
        setattr(out, key, _coerce(value, _type_of(cls, key), f"{section}.{name}.{key}", set_where))
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
    if hardware:
        from titan_te.hardware import check_hardware  # local import: keeps config light

        check_hardware(cfg, where)


def _check_field(key: str, f: dataclasses.Field, value: Any, where: str) -> None:
    """A value within its option's choices and bounds; no float option takes NaN or inf; a path the OS
    can take."""
    if f.metadata.get("path") and isinstance(value, str):
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


def _check_values(cfg: Config, where: str) -> None:
    t = cfg.training
    _check_bounds(cfg, where)
    for step in cfg.profiling.memory_snapshot_steps:
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"profiling.memory_snapshot_steps holds step numbers >= 1, got {step!r} {where}")
    if cfg.fp8.params and not cfg.fp8.enable:
        raise ConfigError(f"fp8.params = true keeps weights in FP8, which needs fp8.enable = true; set "
                          f"--fp8.enable=true, or --fp8.params=false to train without FP8 {where}")
    if cfg.fp8.attention:
        from titan_te.fp8 import RECIPES

        if not cfg.fp8.enable:
            raise ConfigError(f"fp8.attention = true needs fp8.enable = true {where}")
        if RECIPES.get(cfg.fp8.recipe).fp8_attention is None:
            able = ", ".join(n for n in RECIPES.names() if RECIPES.get(n).fp8_attention is not None)
            raise ConfigError(f"fp8.attention: the {cfg.fp8.recipe} recipe has no FP8 attention; recipes "
                              f"with it: {able} {where}")
    for idx in cfg.fp8.bf16_layers:
        if not isinstance(idx, int):
            raise ConfigError(f"fp8.bf16_layers holds block indices (ints), got {idx!r} {where}")

    from titan_te.models import MODELS

    flavors = MODELS.get(cfg.model.name).flavors
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"model.flavor = '{cfg.model.flavor}' is not a flavor of {cfg.model.name}"
                          f"{_closest(cfg.model.flavor, list(flavors))}; valid: {', '.join(flavors)} {where}")
    if cfg.fp8.head != "off":
        _check_fp8_head(cfg, where)

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
    if cfg.model.fuse_wgrad_accumulation:
        why = ("TE then writes each weight gradient into param.main_grad instead of param.grad, so FSDP2 never "
               "reduce-scatters it and every rank would step on its own unreduced gradient"
               if _registry("titan_te.parallel:PARALLELISMS").get(p.data_parallel).reduces_grads_itself else
               "titan_te's optimizers read param.grad, which TE leaves empty in that mode")
        raise ConfigError(f"model.fuse_wgrad_accumulation = true is not supported with parallelism.data_parallel = "
                          f"{p.data_parallel}: {why}; set it to false (gradient accumulation still works) {where}")
    if cfg.checkpoint.load_step == 0 or cfg.checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be a step >= 1, or -1 for the newest checkpoint, got "
                          f"{cfg.checkpoint.load_step} {where}")


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


# ---------------------------------------------------------------------------------------------
# Output: --help and the resolved TOML
# ---------------------------------------------------------------------------------------------
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


