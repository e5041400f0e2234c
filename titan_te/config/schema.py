"""The config's schema: one dataclass per TOML section, each field an `opt()` with a default, a one-line doc
and its rules (choices, a registry whose names are valid, bounds, a path)."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_te.errors import ConfigError


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
        bounds: Bounds | None = None, path: str | None = None, refines: str | None = None):
    """A config field with a default and a one-line doc.

    `choices` is a fixed set of values; `registry` names "module:ATTR" of a Registry whose names
    are the valid values (resolved lazily so custom imports can add entries first); `bounds` is the
    valid interval of a number (every float must also be finite: NaN and inf are never valid); `path`
    marks a file-system path: "run" for one inside the run folder unless absolute, "any" for others;
    `refines` names the on/off option of the same section that this one needs (a file's value goes back to
    the default when the command line turns that option off: loading.build).
    """
    meta = {"doc": doc, "choices": choices, "registry": registry, "bounds": bounds, "path": path,
            "refines": refines}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


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
    fuse_wgrad_accumulation: bool = opt(True, "te backend, where one process trains without a data-parallel "
                                              "reduction (parallelism none, or fsdp / hsdp on one rank with "
                                              "unsharded_one_rank): TE's weight-gradient GEMMs write FP32 "
                                              "gradients in place, adding up micro-batches, instead of bf16 ones "
                                              "that autograd casts; FSDP2 and DDP reduce autograd's gradients, "
                                              "so elsewhere it has no effect")
    attention_kernel: str = opt("auto", "te backend: which kernels attention runs: auto (TE's choice: cuDNN's fused "
                                        "kernels on Hopper), cudnn, or flash (an installed FlashAttention package: "
                                        "flash-attn-4, 3 or 2)", choices=("auto", "cudnn", "flash"))
    wgrad_dtype: str = opt("float32", "the dtype TE's in-place weight gradients (fuse_wgrad_accumulation) are "
                                      "written and added up in: bfloat16 halves their memory and the bytes that "
                                      "clipping and the optimizer read, rounding each gradient (and, with "
                                      "gradient accumulation, each micro-batch's sum) to bf16; needs an optimizer "
                                      "that reads bf16 gradients of FP32 weights (fused_adam)",
                           choices=("float32", "bfloat16"))


@dataclass
class Training:
    steps: int = opt(200, "optimizer steps to train", bounds=Bounds(1, 10**9))
    local_batch_size: int = opt(8, "sequences per micro-batch on each data-parallel rank", bounds=Bounds(1, 2**20))
    global_batch_size: int = opt(-1, "sequences per optimizer step over all ranks (-1: local x dp when the run "
                                     "starts, kept on a resume on another rank count); gradient accumulation = "
                                     "global / (local x dp)")
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
    steps: int = opt(10, "global batches per validation (training.global_batch_size sequences each, the same "
                         "for any number of ranks)", bounds=Bounds(1))
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
    eps: float = opt(1e-8, "Adam epsilon (> 0: a weight whose gradient is still 0, such as an embedding row of a "
                           "token not seen yet, would update by 0/0)", bounds=POSITIVE)
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
    memory_snapshot_steps: list[int] = opt([], "steps after which a CUDA memory snapshot is written")
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
    exclude_from_loading: list[str] = opt([], "parts not restored on resume: model, optimizer, lr_scheduler, "
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
                      registry="titan_te.te.recipes:RECIPES")
    fp8_format: str = opt("HYBRID", "HYBRID (E4M3 forward, E5M2 gradients) or E4M3", choices=("HYBRID", "E4M3"))
    amax_history_len: int = opt(1024, "delayed scaling: amax history length", bounds=Bounds(1, 2**16))
    amax_compute_algo: str = opt("max", "delayed scaling: max or most_recent", choices=("max", "most_recent"))
    margin: int = opt(0, "delayed scaling: margin (power of two) for the scaling factor", bounds=Bounds(0, 64))
    calibrate_first_step: bool = opt(True, "delayed scaling: a run whose gradient scales were never set (a fresh "
                                           "start) first runs one forward and backward of its first micro-batch, "
                                           "gradients discarded, so that its first update is not computed from "
                                           "gradients quantized at the initial scale of 1")
    fused_swiglu: bool = opt(False, "delayed scaling: the backward of TE's bias-free SwiGLU MLPs computes SwiGLU's "
                                    "derivative with its FP8 cast and transpose in one Triton kernel "
                                    "(titan_te/te/swiglu.py) instead of TE's two passes", refines="enable")
    params: bool = opt(False, "keep weights in FP8 (te.quantized_model_init): FSDP2 all-gathers FP8 bytes; "
                              "needs an optimizer with FP32 master weights", refines="enable")
    backward_transposes: bool = opt(False, "FP8 weights used in place (one GPU without FSDP, DDP): TE derives each "
                                           "one's transpose in the backward, where the data gradient needs it, "
                                           "not in every forward; the same numbers, and the transposes (a byte per "
                                           "FP8 weight) are not held through the forward's peak", refines="enable")
    preserve_high_precision_init: bool = opt(True, "fused_adam: seed the FP32 master weights from the "
                                                   "pre-quantization init values")
    bf16_layers: list[int] = opt([], "block indices kept in bf16 (negative counts from the end), e.g. [0, -1]")
    attention: bool = opt(False, "also run attention in FP8 (TE's fp8_dpa through cuDNN; delayed or current "
                                 "scaling): faster, slightly less exact", refines="enable")
    head: str = opt("off", "the fused output head in FP8 (current per-tensor scaling): dgrad = the gradient into "
                           "the model (e5m2 x e4m3), all = the logits too; off = bf16 (torchtitan's and "
                           "Megatron's default); its weight gradient stays bf16", choices=("off", "dgrad", "all"),
                    refines="enable")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "none, full (every block), every_n (every N-th block), mlp (every N-th block "
                            "recomputes only its MLP's norm, first GEMM and activation: te backend) or auto (the "
                            "planner's lightest of these that fits the GPU; none on a CPU)",
                    choices=("none", "full", "every_n", "mlp", "auto"))
    every_n: int = opt(2, "with mode=every_n or mlp: one block out of N (mlp with 1: every block); auto chooses its own",
                       bounds=Bounds(1))


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


def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
            if dataclasses.is_dataclass(f.default_factory)}


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def refinements():
    """(section, its class, key, switch) of every option that refines an on/off option of its section (`refines`)."""
    for section, cls in sections().items():
        for key, f in _fields(cls).items():
            if f.metadata.get("refines"):
                yield section, cls, key, f.metadata["refines"]


def _type_of(section_cls: type, name: str) -> type:
    return _type_hints(section_cls)[name]


@functools.cache
def _type_hints(section_cls: type) -> dict[str, type]:
    """A section's field types, resolved once per class (resolving them for every key set was most of the time
    loading a config took)."""
    return typing.get_type_hints(section_cls)


def _type_name(tp: type) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {list: "list", bool: "bool", int: "int", float: "float", str: "str"}.get(tp, str(tp))


def _closest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _registry_fields(section_cls: type) -> list[str]:
    return [f.metadata["registry"] for f in _fields(section_cls).values() if f.metadata.get("registry")]


def _registry(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


MISSING_VALUE = object()  # a command-line option given without a value


def bare_flag(tp: type, key: str, current: Any, where: str) -> bool:
    """`--key` alone: true for a bool option; any other option needs its value."""
    if tp is bool:
        return True
    example = ",".join(map(str, current)) or "VALUE" if isinstance(current, list) else current
    raise ConfigError(f"--{key} needs a value, e.g. --{key}={example} ({where})")


def _coerce(value: Any, tp: type, key: str, where: str) -> Any:
    """Turn a TOML value or a CLI string into the field's type, or raise ConfigError."""
    bad = ConfigError(f"{key} expects {_type_name(tp)}, got {value!r} ({where})")
    if tp is list or typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0] if typing.get_args(tp) else None
        if isinstance(value, str):  # "dataloader,rng": the command line's form, and read as such in TOML too
            return [_list_item(v.strip(), item, key, where) for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        for v in value:
            if not _is_item(v, item):
                kind = _type_name(tp) if item else "list of numbers, strings or booleans"
                raise ConfigError(f"{key} is a {kind}, got the element {v!r} ({where})")
        return value
    if isinstance(value, str) and tp is not str and where == "on the command line":  # TOML values are typed
        text = value.strip()
        if tp is bool:  # exactly what the README and --help promise
            if text.lower() == "true":
                return True
            if text.lower() == "false":
                return False
            raise ConfigError(f"{key} expects true or false, got {value!r} ({where})")
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
    if tp is str and isinstance(value, str):
        return value
    raise bad


def _is_item(v: Any, item: type | None) -> bool:
    """A list's element of the declared type (an int is never a bool); an untyped list holds scalars."""
    if item is None:
        return isinstance(v, (int, float, str, bool))
    return isinstance(v, item) and not (item is int and isinstance(v, bool))


def _list_item(text: str, item: type | None, key: str, where: str):
    """One comma-separated element: typed as the list declares; untyped, an int where it reads as one."""
    if item is str:
        return text
    try:
        return int(text)
    except ValueError:
        if item is int:
            raise ConfigError(f"{key} is a list of int, got the element {text!r} ({where})") from None
        return text
