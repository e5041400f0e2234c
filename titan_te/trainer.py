"""The Trainer: built in a fixed, readable order, then a plain training loop.

Build order (each stage receives only its own config section):
 1. distributed init and the data-parallel mesh
 2. tokenizer, dataset and the stateful data loader (sharded by data-parallel rank)
 3. the model on the meta device, from the model registry with the chosen layer backend
 4. activation checkpointing, compile, then the parallelism from its registry (fully_shard ...)
 5. materialize and initialize the weights (the same full weights for any world size)
 6. optimizer and LR schedule
 7. checkpoint manager: resume from the newest complete checkpoint (or start from HF weights)
 8. metrics
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from titan_te import config as config_mod
from titan_te.checkpoint import CheckpointManager, complete_steps, training_parts
from titan_te.checkpoint.folder import checkpoint_folder, saved_global_batch
from titan_te.data import DATASETS, TOKENIZERS
from titan_te.data.loader import DataPosition, build_dataloader, ended_worker, stop_workers, worker_death
from titan_te.data.tokenizers import padded_vocab
from titan_te.hardware import resolve_backend, resolve_device
from titan_te.init_weights import init_weights
from titan_te.layers import BACKENDS
from titan_te.loss import IGNORE_INDEX, token_loss_sum
from titan_te.metrics import DeviceValues, MetricsLogger, PendingStep, causal_flops_per_token
from titan_te.models import MODELS
from titan_te.optim import OPTIMIZERS
from titan_te.optim.lr_schedule import build_lr_scheduler
from titan_te.parallel import PARALLELISMS, select as parallel_select
from titan_te.parallel.auto_checkpoint import resolve as resolve_auto_checkpoint
from titan_te.parallel.data_parallel import mixed_precision
from titan_te.parallel.dims import ParallelDims
from titan_te.parallel.dist import SHARE_GPU, init_distributed, on_rank0, shared_gpu
from titan_te.parallel.wrappers import apply_activation_checkpoint, apply_compile
from titan_te.errors import ConfigError, Diverged, Interrupted, OutOfMemory, UserError
from titan_te.preemption import SIGNALS, preempted
from titan_te.te.policy import FP8Policy
from titan_te.te.stats import fp8_stats
from titan_te.te.wgrad import WeightGradBuffers
from titan_te.run_folder import FolderLock, attach_log_file, detach_log_file, log_to_file
from titan_te.profiling import Profiler
from titan_te.validation import Validator
from titan_te.memory_estimate import check_fits, local_world
from titan_te.train_utils import clip_grad_norm, global_batch_plan, set_determinism, training_state_finite

logger = logging.getLogger("titan_te")


def _describe_data(d, v, source, val_source, tokenizer) -> str:
    """The start-up line naming what the run trains and validates on."""

    def size(src) -> str:
        shards = getattr(src, "shards", None)
        return f"{len(shards)} shard(s), {src.num_tokens:,} tokens" if shards is not None else "streamed"

    path = f", path {d.path}" if d.path else ""
    if val_source is None:
        val = "off"
    elif getattr(source, "validation", None) is val_source:
        val = f"the dataset's own split ({size(val_source)})"
    else:
        val = f"held-out {v.hold_out_fraction:.1%} of the training tokens ({size(val_source)})"
    return (f"data: dataset {d.dataset}{path} ({getattr(source, 'name', d.dataset)}), tokenizer {d.tokenizer} "
            f"(vocab {tokenizer.vocab_size:,}): {size(source)}; validation: {val}")


def is_host_oom(err: RuntimeError) -> bool:
    """torch's CPU allocator failing (it raises a plain RuntimeError)."""
    return "DefaultCPUAllocator: can't allocate memory" in str(err) or "not enough memory" in str(err)


def out_of_memory(step: int, err: Exception, snapshot) -> OutOfMemory:
    where = f"; memory snapshot: {snapshot}" if snapshot else \
        "; --profiling.enable_memory_snapshot=true writes a snapshot of who held the memory"
    kind = "GPU" if isinstance(err, torch.OutOfMemoryError) else "host"
    return OutOfMemory(f"out of {kind} memory in step {step} ({str(err).splitlines()[0][:200]}). Try "
                       f"--activation_checkpoint.mode=full, a smaller training.local_batch_size (with "
                       f"training.global_batch_size for the same batch), or more GPUs{where}")


@contextlib.contextmanager
def _loader_workers_can_die(loader):
    """A loader worker that the kernel ends is one line (torch raises it wherever the main thread is, so the
    step it interrupts is left unsaved; inside a checkpoint save DCP wraps it into its CheckpointException)."""
    try:
        yield
    except (RuntimeError, CheckpointException) as e:
        death = worker_death(e, loader)
        if death is None:
            raise
        raise death from None


@dataclass
class TrainState:
    """Progress counters; a Stateful so the checkpoint sees it as one object."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


class Trainer:
    def __init__(self, cfg: config_mod.Config):
        self.cfg = cfg
        self._lock = None
        try:
            self._build(cfg)
        except BaseException as e:
            try:
                self._log_end(type(e), e, e.__traceback__)
            finally:
                self._release()
            raise

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._log_end(exc_type, exc, tb)
        finally:
            self.close()

    @staticmethod
    def _log_end(exc_type, exc, tb) -> None:
        """The run's log file also says how it ended: a user's line, or a bug's traceback."""
        if exc is not None:
            log_to_file(exc.line() if isinstance(exc, (UserError, Interrupted)) else
                        "".join(traceback.format_exception(exc_type, exc, tb)).rstrip())

    def _build(self, cfg: config_mod.Config) -> None:
        """The numbered recipe; each stage builds its parts from its own config sections."""
        self.env = self._distributed(cfg.training, cfg.parallelism)  # 1.
        self._batch(cfg.training, cfg.checkpoint, cfg.run_folder)
        self._claim_run_folder(cfg.run_folder, cfg.job)
        val_source = self._data(cfg.data, cfg.validation, cfg.training)  # 2.
        self.optimizer_spec = OPTIMIZERS.get(cfg.optimizer.name)
        model = self._model(cfg.model, cfg.fp8, cfg.training, cfg)  # 3.
        self.train_model = self._parallelize(model, cfg.parallelism, cfg.activation_checkpoint, cfg.compile,
                                             cfg.training)  # 4.
        self._initialize(model, cfg.training, cfg.model)  # 5.
        self._optimizer(model, cfg)  # 6.
        self._checkpoints(model, cfg.checkpoint, cfg.training)  # 7.
        self._outputs(cfg, val_source)  # 8.
        if self.env.is_main:
            self._write_resolved_config()
            self._log_summary()
            self._log_resume()

    def _distributed(self, t, p):
        """1. Rendezvous, the process group and the data-parallel mesh."""
        SIGNALS.doing("joining the process group")
        self.device_type = resolve_device(t.device)
        dims = ParallelDims.from_config(p, config_mod.world_size_from_env())
        env = init_distributed(self.device_type, dims, p.comm_timeout_s, p.rendezvous_timeout_s)
        self.device = env.device
        set_determinism(t.seed, t.deterministic)
        return env

    def _batch(self, t, ck, run_folder: Path) -> None:
        """1b. Sequences per step: the configured global batch, or (-1) the one the run started with."""
        folder = checkpoint_folder(ck, run_folder)
        resumes = ck.enable and "train_state" not in ck.exclude_from_loading  # else it counts from step 1 again
        saved = on_rank0(lambda: saved_global_batch(folder, ck.load_step)) if resumes else None
        self.grad_accum, self.global_batch, self._batch_note = global_batch_plan(t, self.env.dp_world, saved)
        self.tokens_per_step = self.global_batch * t.seq_len

    def _claim_run_folder(self, folder: Path, job) -> None:
        """One trainer per run folder: rank 0 holds its lock until close (a dead holder's is taken over)."""
        self.run_folder = folder
        self._lock = FolderLock(folder, "run folder", "choose another --job.dump_folder or --job.name",
                                holder=f"job {job.name}")
        on_rank0(self._lock.acquire)
        self.log_file = attach_log_file(folder, self.env.rank)

    def _data(self, d, v, t):
        """2. Tokenizer, dataset (and its held-out part) and the loader; returns the validation source."""
        SIGNALS.doing("reading the data")
        env = self.env
        self.tokenizer = TOKENIZERS.get(d.tokenizer)(d)
        source = DATASETS.get(d.dataset)(d, self.tokenizer)
        val_source = None
        if v.enable:  # the dataset's own split, else a held-out tail of its tokens
            val_source = source.validation
            if val_source is None:
                source, val_source = source.split(v.hold_out_fraction)
        self._data_line = _describe_data(d, v, source, val_source, self.tokenizer)
        self.dataloader = build_dataloader(source, t.seq_len, t.local_batch_size, env.dp_rank, env.dp_world,
                                           t.seed, d.shuffle, d.num_workers, pin_memory=self.device_type == "cuda",
                                           global_batch=self.global_batch)
        # where the data stands, the same on every rank: resumes on any number of ranks and loader workers
        self.data_position = DataPosition() if getattr(self.dataloader.dataset, "global_position", False) else None
        return val_source

    def _model(self, m, f, t, cfg):
        """3. The model on the meta device (FP8 weights inside TE's quantized_model_init), after the check
        that it can fit at all."""
        SIGNALS.doing("building the model")
        self.model_spec = spec = MODELS.get(m.name)
        self.backend = resolve_backend(m.backend, self.device_type, spec.backends)
        logger.info(f"layer backend: {self.backend} (model.backend = {m.backend})")
        self._attention = BACKENDS.get(self.backend).attention  # the backend's attention kernels, if it has a choice
        self._attention_said = self._attention is None  # which kernels ran: logged after the first step
        if self._attention is not None:
            self._attention.use(m.attention_kernel)
        self.fp8 = FP8Policy(f, amax_group=dist.group.WORLD)  # amax reduced over data parallel
        self.model_args = spec.args_for(m.flavor, padded_vocab(self.tokenizer.vocab_size), t.seq_len, m.n_layers)
        self._check_attention_kernel(m.attention_kernel, self.model_args)
        # refuse a run that cannot fit before building it (a CPU run would be killed by the kernel)
        check_fits(cfg, self.model_args, self.optimizer_spec, self.device, self.env.dims.size("dp_shard"),
                   local_world(), fused_head=m.fused_loss and spec.computes_loss)
        logger.info(f"building the model ({self.model_args.num_params() / 1e6:,.1f} M parameters) on "
                    f"{self.device}")
        with torch.device("meta"):
            model = spec.build(self.model_args, self.backend, document_mask=m.document_mask,
                               fp8=self.fp8 if self.fp8.enabled else None, params_dtype=torch.float32)
        self.fp8.model_built(model)
        self.model = model  # the unwrapped module: names, init rules, state dicts
        return model

    def _parallelize(self, model, p, ac, compile_cfg, t):
        """4. Activation checkpointing, compile, then the data parallelism from its registry."""
        apply_activation_checkpoint(model, self._recomputation(ac))
        if compile_cfg.enable:
            apply_compile(model, self.backend)
        mp = mixed_precision(self.device_type, t.mixed_precision_param, t.mixed_precision_reduce)
        parallel = parallel_select(p, self.env.world_size)
        self.parallel = parallel.name
        self._no_sync = parallel.no_sync
        train_model = parallel.apply(model, self.env, p, mp, self.model_spec.fsdp_units(model), self.fp8)
        # Without FSDP's parameter cast, GPU compute runs under torch.autocast in the same dtype.
        self._amp = (self.device_type == "cuda" and not parallel.casts_params and mp.param_dtype != torch.float32)
        self._amp_dtype = mp.param_dtype
        return train_model

    def _recomputation(self, ac):
        """4a. activation_checkpoint.mode = auto: the planner's lightest recomputation that fits this GPU (the
        smallest over the ranks), which the run folder's config.toml then records."""
        ranks_per_gpu = local_world() if self.env.shared_gpu else 1
        ac, line, fits = resolve_auto_checkpoint(self.cfg, self.device, self.env.world_size, ranks_per_gpu,
                                                 self.tokenizer.vocab_size, BACKENDS.get(self.backend).recomputes_mlp)
        if line:
            (logger.info if fits else logger.warning)(line)
        self.cfg.activation_checkpoint = ac
        return ac

    def _initialize(self, model, t, mcfg) -> None:
        """5. Materialize and initialize: the same full weights for any world size and seed; with
        fp8.backward_transposes FP8 weights used in place derive their transposes only for the backward; then
        TE's in-place weight gradients where they apply (model.fuse_wgrad_accumulation)."""
        backend_spec = BACKENDS.get(self.backend)
        if any(p.is_meta for p in model.parameters()):
            if backend_spec.materialize:
                backend_spec.materialize(model, self.device)
            else:
                model.to_empty(device=self.device)
        write = backend_spec.write
        if write is not None and self.optimizer_spec.takes_high_precision_init:
            write = self.fp8.writer(write)  # keeps FP8 weights' values before quantization for the optimizer
        self._write = write  # Hugging Face weights are written the same way (stage 7)
        init_weights(model, model.init_rule, t.seed, self.device, write=write)
        model.init_buffers(self.device)
        self.fp8.weights_initialized(model)
        # on the materialized weights (TE's reset_parameters makes new ones)
        self.wgrads = WeightGradBuffers(model, mcfg.fuse_wgrad_accumulation and
                                        PARALLELISMS.get(self.parallel).local_grads, getattr(torch, mcfg.wgrad_dtype))
        if len(self.wgrads):
            logger.info(f"weight gradients: {len(self.wgrads)} written in {mcfg.wgrad_dtype} by TE's GEMMs "
                        f"(model.fuse_wgrad_accumulation, model.wgrad_dtype)")

    def _optimizer(self, model, cfg) -> None:
        """6. The optimizer (with its own [optimizer.<name>] options, if it declares any) and the LR schedule."""
        opt_spec = self.optimizer_spec
        own = {"options": config_mod.component_options(cfg, "optimizer", opt_spec.name)} if opt_spec.options else {}
        if opt_spec.takes_high_precision_init:
            own["init_value"] = self.fp8.init_value
        self.optimizer = opt_spec.build(list(model.named_parameters()), cfg.optimizer, self.device_type, **own)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)

    def _checkpoints(self, model, ck, t) -> None:
        """7. The checkpoint manager: resume, or start from Hugging Face weights."""
        SIGNALS.doing("resuming")
        env = self.env
        self.state = TrainState()
        parts = training_parts(model, self.optimizer, self.lr_scheduler, self.dataloader, self.state, env.dp_rank,
                               env.dp_world, export_dtype=getattr(torch, ck.export_dtype),
                               data_position=self.data_position,
                               optimizer_state_bytes=functools.partial(self.optimizer_spec.state_bytes,
                                                                       self.cfg.optimizer))
        folder = checkpoint_folder(ck, self.run_folder)
        # a background save copies the weights while the next forward/backward runs: the manager's hook keeps
        # the optimizer from changing them before the copy is complete; a step's line is logged before its save
        self.checkpointer = CheckpointManager(ck, folder, parts, env, self._facts(), t.steps, self.run_folder,
                                              optimizer=self.optimizer, before_save=self._read_step_values,
                                              on_saved=self._log_save)
        resumed = self.checkpointer.resume()
        if not resumed and ck.initial_load_path:
            spec = self.model_spec
            if spec.hf is None:
                raise ConfigError(f"checkpoint.initial_load_path: model {spec.name} has no Hugging Face adapter")
            # as init writes: fused_adam then seeds its FP32 masters from these values, not from init's
            spec.hf.load_hf_weights(model, ck.initial_load_path, self._write)
            logger.info(f"initial weights from {ck.initial_load_path}")
        elif resumed:  # the weights are the checkpoint's: init's values must not seed fused_adam's masters
            self.fp8.drop_init_values()

    def _outputs(self, cfg, val_source) -> None:
        """8. Metrics (console, TensorBoard, metrics file), the profiler, validation."""
        t, env = cfg.training, self.env
        self.metrics = MetricsLogger(cfg.metrics, self.run_folder, self.device, env.rank,
                                     self.model_args.flops_per_token(t.seq_len), t.steps, start_step=self.state.step,
                                     causal_flops_per_token=causal_flops_per_token(self.model_args, t.seq_len))
        self.profiler = Profiler(cfg.profiling, self.run_folder, self.device, env.rank)
        self.validator = None if val_source is None else Validator(
            cfg.validation, val_source, t.seq_len, t.local_batch_size, env.dp_rank, env.dp_world, self.global_batch,
            pin_memory=self.device_type == "cuda", device=self.device)
        self._stop_vote = torch.zeros((), device=self.device)  # 1 once this rank was asked to stop
        self._voted = False

    # ------------------------------------------------------------------------------------------
    def _facts(self) -> dict:
        """What a checkpoint must agree with to load into this run (kept in its manifest), and what the
        export tool needs to rebuild the model from the checkpoint alone."""
        a, o, tok = self.model_args, self.cfg.optimizer, self.tokenizer
        identity = getattr(tok, "identity", None) or {"kind": self.cfg.data.tokenizer, "vocab_size": tok.vocab_size}
        return {"model": {"name": self.cfg.model.name, "flavor": self.cfg.model.flavor, "n_layers": a.n_layers,
                          "dim": a.dim, "vocab_size": a.vocab_size},
                "optimizer": {"name": o.name, **self.optimizer_spec.facts(
                    o, config_mod.component_options(self.cfg, "optimizer", o.name))},
                "tokenizer": dict(identity), "settings": self.cfg.settings(),
                "data": {"global_batch": self.global_batch},  # what global_batch_size = -1 keeps on a resume
                "export": {"seq_len": self.cfg.training.seq_len, "custom_import": self.cfg.job.custom_import,
                           "bos_id": int(tok.bos_id), "eos_id": int(tok.eos_id)}}

    def _write_resolved_config(self) -> None:
        path = self.run_folder / "config.toml"
        try:
            path.write_text(config_mod.to_toml(self.cfg))
        except OSError as e:  # a full or read-only disk: the run could not write its logs or checkpoints either
            raise ConfigError(f"run folder {self.run_folder}: cannot write {path.name} ({e.strerror or e}); free "
                              f"space there or choose another --job.dump_folder") from None

    def _log_summary(self) -> None:
        a, t, p = self.model_args, self.cfg.training, self.cfg.parallelism
        n = a.num_params()
        fp8 = f"on ({self.cfg.fp8.recipe})" if self.cfg.fp8.enable else "off"
        if self.cfg.job.description:
            logger.info(f"job {self.cfg.job.name}: {self.cfg.job.description}")
        logger.info(f"model {self.cfg.model.name} {self.cfg.model.flavor}: {n / 1e6:,.1f} M parameters, "
                    f"{a.n_layers} layers, dim {a.dim}, vocab {a.vocab_size}, backend {self.backend}")
        ran = "" if self.parallel == p.data_parallel else \
            f" (parallelism.unsharded_one_rank: runs as {self.parallel}, without FSDP's copies)"
        shared = ""
        if self.env.shared_gpu:
            shared = f"; {SHARE_GPU}=1: every rank on {self.device} over gloo, a testing mode (slow, not for training)"
        elif shared_gpu():  # asked for, on the CPU
            shared = f"; {SHARE_GPU}=1 has no effect here (it puts the ranks of a GPU run on one GPU)"
        logger.info(f"parallel: {p.data_parallel}{ran} on {self.env.world_size} rank(s) "
                    f"({' x '.join(f'{n} {s}' for n, s in self.env.dims.dims)}), device {self.device}{shared}")
        if self._batch_note:
            logger.info(self._batch_note)
        logger.info(f"batch: {t.local_batch_size} x {t.seq_len} tokens per micro-batch, grad accumulation "
                    f"{self.grad_accum}, {self.tokens_per_step:,} tokens per step, "
                    f"{self.model_args.flops_per_token(t.seq_len) * self.tokens_per_step / 1e12:,.2f} TFLOP per step")
        logger.info(self._data_line)
        logger.info(f"fp8: {fp8}; MFU is measured against the dense bf16 peak; run folder {self.run_folder}")
        warmup = self.cfg.lr_scheduler.warmup_steps
        if warmup >= t.steps:
            logger.warning(f"lr_scheduler.warmup_steps = {warmup} is not shorter than training.steps = {t.steps}: "
                           f"the learning rate never reaches optimizer.lr")

    def _log_resume(self) -> None:
        """What a resumed run took from its checkpoint, and which options changed since it was saved (this
        run's values apply: the peak lr, the schedule's shape, the optimizer's hyperparameters ...)."""
        m = self.checkpointer.resumed_from
        if m is None:
            return
        saved = m.facts.get("settings", {})
        changed = [f"{k} {saved[k]!r} -> {v!r} ({self.cfg.origins.get(k, 'default').replace('on the ', '')})"
                   for k, v in self.cfg.settings().items() if k in saved and saved[k] != v]
        parts = ", ".join(p for p in m.parts if p not in self.cfg.checkpoint.exclude_from_loading)
        logger.info(f"resume: from step-{m.step}: {parts}; "
                    + (f"changed since it was saved, applied now: {'; '.join(changed[:10])}"
                       + (f" and {len(changed) - 10} more" if len(changed) > 10 else "") if changed else
                       "every option as it was saved"))

    def _next_microbatches(self) -> tuple[list[dict], int]:
        """The step's micro-batches (input and labels on the device) and the epoch they come from."""
        batches = [next(self._data_iter) for _ in range(self.grad_accum)]
        epoch = int(batches[-1]["epoch"].max())  # read on the host: no device sync
        return [{k: b[k].to(self.device, non_blocking=True) for k in ("input", "labels")} for b in batches], epoch

    def forward_context(self):
        stack = contextlib.ExitStack()
        if self._amp:
            stack.enter_context(torch.autocast(self.device.type, dtype=self._amp_dtype))
        stack.enter_context(self.fp8.autocast())
        return stack

    def _doc_kwargs(self, inp: torch.Tensor) -> dict:
        return {"doc_start": inp == self.tokenizer.bos_id} if self.cfg.model.document_mask else {}

    def loss_sum(self, inp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy summed over the valid tokens of one micro-batch: from the model's fused head
        when its spec computes the loss (and model.fused_loss), else from the full logits."""
        with self.forward_context():
            if self.model_spec.computes_loss and self.cfg.model.fused_loss:
                return self.train_model(inp, labels=labels, **self._doc_kwargs(inp))
            return token_loss_sum(self.train_model(inp, **self._doc_kwargs(inp)), labels)

    @property
    def losses(self) -> list[float]:
        """The global average loss of every step so far, for callers and tests."""
        return self.metrics.losses

    def train_step(self, microbatches, calibrate: bool = False) -> torch.Tensor:
        """One optimizer step over the micro-batches. Returns [global avg loss, max rank loss, grad norm, ranks
        asked to stop] as one device tensor: nothing here waits for the GPU. `calibrate`: first a forward and
        backward of the first micro-batch whose gradients are discarded (FP8Policy.needs_calibration)."""
        local_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches).float()
        if SIGNALS.flag and not self._voted:
            self._stop_vote.fill_(1.0)
            self._voted = True
        # One all-reduce for the token count and the stop votes: a stop request costs no collective of its own.
        counts = torch.stack([local_tokens, self._stop_vote])
        dist.all_reduce(counts)
        global_tokens = counts[0]
        if calibrate:  # the same loss scale as the step's own passes: the gradients' amaxes are the step's
            self.wgrads.microbatch(first=True)
            (self.loss_sum(microbatches[0]["input"], microbatches[0]["labels"]) / global_tokens).backward()
            self.optimizer.zero_grad(set_to_none=True)
        # Each micro-batch's summed loss is divided by the GLOBAL count of valid tokens, and the
        # data-parallel reduction sums gradients: the result is the exact mean over the global batch,
        # whatever the split into ranks and micro-batches.
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(microbatches):
            reduce_now = self._no_sync is None or i == len(microbatches) - 1  # the last reduces the local sum
            self.wgrads.microbatch(first=i == 0)
            with contextlib.nullcontext() if reduce_now else self._no_sync(self.train_model):
                loss = self.loss_sum(mb["input"], mb["labels"]) / global_tokens
                loss.backward()
            loss_sum += loss.detach()
        self.wgrads.publish()
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.max_norm, self.optimizer)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.wgrads.release()
        rank_loss = loss_sum * global_tokens / local_tokens.clamp(min=1)
        dist.all_reduce(loss_sum)
        dist.all_reduce(rank_loss, op=dist.ReduceOp.MAX)
        return torch.stack([loss_sum, rank_loss, grad_norm.to(loss_sum.dtype), counts[1].to(loss_sum.dtype)])

    def train(self, until_step: int | None = None) -> list[float]:
        """Train to training.steps (or stop after `until_step`, as a crash would); returns the losses.

        A step's values (loss, grad norm, stop votes) stay on the device and are read after the next step has
        been queued (MetricsLogger), so the host never waits for the GPU between steps (except for validation,
        FP8 statistics and synchronous saves). A stop request is seen in the values of a step that every rank
        reads at the same point, so all ranks stop after the same step, save it, and exit 75. A loader worker
        the kernel ends anywhere in here (its workers live until close()) is one line."""
        with _loader_workers_can_die(self.dataloader):
            return self._train(until_step)

    def _train(self, until_step: int | None) -> list[float]:
        t = self.cfg.training
        stop_at = min(until_step or t.steps, t.steps)
        if self.state.step >= t.steps:
            logger.info(f"nothing to train: the run is at step {self.state.step} and training.steps = {t.steps}; "
                        f"raise training.steps to train on")
        else:
            logger.info(f"training from step {self.state.step + 1} to {t.steps}")
        self.train_model.train()
        calibrate = self.state.step < stop_at and self.fp8.needs_calibration(self.model)
        if calibrate:
            logger.info("fp8: the first step runs a calibration pass first (gradient scales not set yet; "
                        "fp8.calibrate_first_step)")
        with SIGNALS.training(), self.profiler.loop(self.state.step + 1):
            self._data_iter = iter(self.dataloader)
            self.metrics.start_loop()
            while self.state.step < stop_at:
                step = self.state.step + 1
                t0 = time.perf_counter()
                microbatches, epoch = self._next_microbatches()
                t_data = time.perf_counter() - t0
                lr = self.optimizer.param_groups[0]["lr"]
                try:
                    values = self.train_step(microbatches, calibrate)
                    calibrate = False
                    if not self._attention_said:
                        self._say_attention_kernels()
                except torch.OutOfMemoryError as e:
                    self.metrics.flush()
                    snap = self.profiler.snapshot(f"oom-step-{step}")
                    raise out_of_memory(step, e, snap) from None
                except RuntimeError as e:
                    if not is_host_oom(e):
                        raise
                    raise out_of_memory(step, e, None) from None
                self.state.step = step
                self.state.tokens_seen += self.tokens_per_step
                if self.data_position is not None:
                    self.data_position.advance(self.global_batch, self.dataloader.dataset.n_windows)
                self.metrics.step_done(PendingStep(DeviceValues(values, self.device), step, lr, epoch, t_data,
                                                   self.tokens_per_step // self.env.dp_world))
                self._stop_if_diverged()
                stop = self.metrics.stop_votes > 0
                self.checkpointer.step_end(step, stop=stop)
                self._periodic_metrics(step)
                self.profiler.step_end(step)
                if stop:
                    self.metrics.flush()
                    raise preempted(step, self.checkpointer.enabled)
        self._read_step_values()
        self.checkpointer.flush()
        if self.state.step >= t.steps:
            ck = self.checkpointer
            saved = complete_steps(ck.folder) if ck.enabled else []
            logger.info(self.metrics.summary(self.state.step, self.state.tokens_seen, self.tokens_per_step,
                                             f"checkpoints in {ck.folder} (newest step-{saved[-1]})" if saved else
                                             "no checkpoints"))
        return self.losses

    def _check_attention_kernel(self, kernel: str, a) -> None:
        """3a. The attention kernel the run asked for computes causal attention as torch does, at the model's head
        widths, before the run trains with it (an installed package that TE misuses is the machine's problem)."""
        if self._attention is None:
            return
        reason = self._attention.check(kernel, a.n_heads, a.n_kv_heads, a.head_dim, self.device)
        if reason:
            raise ConfigError(f"model.attention_kernel = {kernel}: {reason}; use --model.attention_kernel=cudnn")

    def _say_attention_kernels(self) -> None:
        """After this process's first step: which kernels attention ran (model.attention_kernel), with a warning
        where TE did not run the FlashAttention package the run asked for."""
        kernel, ran = self.cfg.model.attention_kernel, self._attention.ran()
        self._attention_said = True
        if kernel == "flash" and not ran.startswith("FlashAttention"):
            logger.warning(f"model.attention_kernel = flash, but TE ran {ran} for these shapes (its backend rules "
                           f"refused FlashAttention; NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints why)")
        else:
            logger.info(f"attention ran {ran} (model.attention_kernel = {kernel})")

    def _read_step_values(self) -> None:
        """Before a save and at the end: read (and log) the step still pending; its weights are saved only if
        its loss, its grad norm and the weights and optimizer state it left are finite."""
        self.metrics.flush()
        self._stop_if_diverged()
        if not training_state_finite(self.model, self.optimizer):
            self._diverged(self.state.step, f"step {self.state.step} left weights or optimizer state that are not "
                                            f"finite (its update overflowed)", broken="the training state is")

    def _stop_if_diverged(self) -> None:
        """A step whose loss or grad norm is NaN / inf has made the weights non-finite: stop before any save
        of them (every rank reads the same values at the same point, so all stop together)."""
        bad = self.metrics.nonfinite
        if bad is not None:
            self._diverged(bad.step, f"step {bad.step} has loss {bad.loss} and grad norm {bad.grad_norm}")

    def _diverged(self, step: int, what: str, broken: str = "the weights are") -> None:
        ck = self.checkpointer
        ck.flush()  # a save still in flight is of an earlier step, whose values were finite: it lands
        saved = complete_steps(ck.folder) if ck.enabled else []
        kept = (f"the newest checkpoint, step-{saved[-1]}, is from before it and rerunning the command resumes "
                f"there" if saved else "no checkpoint of this run was saved before it")
        raise Diverged(f"{what}: {broken} not finite any more, so nothing from step {step} on is saved; "
                       f"{kept}. Lower --optimizer.lr, lengthen --lr_scheduler.warmup_steps, or look at the data "
                       f"of step {step}")

    def _log_save(self, rec) -> None:
        self.metrics.write({"checkpoint/stall_s": rec.stall_s, "checkpoint/save_s": rec.total_s}, rec.step)

    def _periodic_metrics(self, step: int) -> None:
        """Values logged at their own frequency: validation loss, FP8 scaling statistics."""
        if self.validator is not None and self.validator.due(step):
            self.metrics.flush()  # the step's own line first
            val_loss = self.validator.run(self.train_model, self.loss_sum)
            self.metrics.write({"loss_metrics/validation_loss": val_loss}, step)
            logger.info(f"step {step:>6}  validation loss {val_loss:8.4f}")
        freq = self.cfg.metrics.fp8_stats_freq
        if self.fp8.enabled and freq and (step % freq == 0 or step == 1):
            self.metrics.write(fp8_stats(self.model, self.model_spec.fp8_stat_groups), step)

    def close(self) -> None:
        """The loader's workers stop first: then no worker's death (torch raises it in the main thread, wherever
        that is) can interrupt the wait for the last save. That save is awaited whatever happens before it."""
        try:
            try:
                self._stop_loader_workers()
            finally:
                self.checkpointer.close()
                self.metrics.close()
                self.profiler.close()
        finally:
            self._release()

    def _stop_loader_workers(self) -> None:
        """A worker that the kernel ends while they stop (after the last step) cost nothing: a warning."""
        try:
            stop_workers(self.dataloader)
        except RuntimeError as e:
            ended = ended_worker(e, self.dataloader)
            if ended is None:
                raise
            logger.warning(f"data-loader worker (pid {ended[0]}) was killed ({ended[1]}) as the run ended; no "
                           f"step or save needed it")
            stop_workers(self.dataloader)  # the others, if torch's word came before it began to stop them

    def _release(self) -> None:
        detach_log_file()
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.release()
        if self._lock is not None:
            self._lock.release()
