"""A planner for the machines you do not have: memory, checkpoint, communication and speed per rank.

    python -m titan_te.plan --config llama_fp8 --ngpu 8 [--nnodes 1] [--gpu H200] [--breakdown bench.json]
                            [--section.key=value ...]

Needs no GPU: the model is built on the meta device with the torch backend, whose parameters have the
same names and shapes as the te backend's. Per rank it prints the parameters, weight bytes by kind
(FP8 / bf16 / FP32), gradients, optimizer state, activations for each activation-checkpoint mode, the
transient buffers of FSDP's gathers, the peak estimate against the GPU's memory, one checkpoint's
size, and the bytes FSDP all-gathers and reduce-scatters per step. The step time is a measured
single-GPU step (`benchmarks/train_bench.py --json`) scaled to the rank's batch, plus communication at
the stated link bandwidths, with and without overlap; without a measurement, FLOPs at an assumed MFU.

What it cannot know: allocator fragmentation and caching (peaks are of allocated memory), kernels'
workspaces beyond a fixed allowance, NCCL's buffers, how well communication really overlaps, links
slower than stated, stragglers. The README compares its estimates with measured runs.
"""
from __future__ import annotations

from titan_te.preemption import SIGNALS

if __name__ == "__main__":
    SIGNALS.install_early()  # before the imports below: a Ctrl-C while they load is one line too

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    memory: int  # bytes, as torch reports total_memory
    peak_flops: float  # dense bf16
    # TE keeps a transposed FP8 copy of every FP8 weight it uses in place (Hopper's FP8 GEMMs take one layout
    # only; it is made when the weight is and kept: _reset_caches marks it stale, it does not free it), and of
    # some FP8 activations it saves for the backward (activation_bytes_per_token_layer)
    fp8_transpose: bool = False


GPUS = {"H200": GPU(143_771 * 2**20, 989e12, fp8_transpose=True),
        "H100": GPU(81_559 * 2**20, 989e12, fp8_transpose=True),
        "B200": GPU(183_359 * 2**20, 2250e12),
        "A100": GPU(81_920 * 2**20, 312e12)}
NVLINK_GBS, IB_GBS = 450.0, 50.0  # per GPU, one direction: NVLink 4 (H100/H200), 400 Gb/s InfiniBand NDR
WORKSPACE = 2 * GiB  # CUDA context, cuBLAS / cuDNN / TE workspaces: a fixed allowance
# the caching allocator's free memory lies in pieces: a peak this close under the card's memory can still fail to
# find one large buffer, so such a plan is "tight", not "fits" (the README has the run that showed it)
ALLOCATOR_SLACK = 0.05
ASSUMED_MFU = 0.75  # without a measured breakdown (the FP8 presets measured 79-84% on one H200)
CHUNK_LOGITS_BYTES = GiB  # the fused head's bf16 logits of one chunk (loss.CHUNK_LOGITS x 2 bytes, Triton path)
AC_MODES = ("none", "mlp", "every_n", "full")  # by what they recompute, least first


@dataclass
class Plan:
    rows: list[tuple[str, str]] = field(default_factory=list)
    peak: dict[str, float] = field(default_factory=dict)  # activation-checkpoint mode -> bytes per rank
    kept_gathered: dict[str, float] = field(default_factory=dict)  # mode -> gathered FP8 blocks kept to backward
    fits: dict[str, bool] = field(default_factory=dict)
    checkpoint_bytes: float = 0.0
    gather_bytes: float = 0.0
    scatter_bytes: float = 0.0
    step_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: dict[str, float] = field(default_factory=dict)


def _answers_for_itself(args) -> bool:
    """A model whose args give `activation_bytes_per_token(fp8)`: the planner takes its figure and assumes no
    TE block layout (no MLP to recompute apart)."""
    return getattr(args, "activation_bytes_per_token", None) is not None


def activation_bytes_per_token_layer(args, fp8: bool, fp8_transposes: bool) -> float:
    """Bytes one block keeps per token for its backward (no recomputation), from what a TE block saves:
    both norms' inputs (bf16), their outputs (FP8 with FP8 GEMMs, else bf16), q, k, v and the attention
    output (bf16, flash attention: no score matrix), the output projection's input (FP8 copy), the MLP's
    pre-activation (2 x ffn, bf16) and its activation output (FP8 or bf16). `fp8_transposes` (GPUs whose FP8
    GEMMs take one layout): TE 2.20's LayerNormMLP saves its norm output in both FP8 layouts, where
    LayerNormLinear keeps the column-wise one only. Models whose args give `activation_bytes_per_token`
    answer for themselves."""
    if _answers_for_itself(args):
        return args.activation_bytes_per_token(fp8)
    d, kv, low = args.dim, args.n_kv_heads * args.head_dim, 1 if fp8 else 2
    return (2 * d + low * d + 2 * (d + 2 * kv) + 2 * d + (1 if fp8 else 0) * d + 2 * d
            + mlp_recomputed_bytes_per_token_layer(args, fp8, fp8_transposes))


def mlp_recomputed_bytes_per_token_layer(args, fp8: bool, fp8_transposes: bool) -> float:
    """Of activation_bytes_per_token_layer, what a block that recomputes its MLP's norm, FC1 and activation in the
    backward (activation_checkpoint.mode = mlp, TE's LayerNormMLP checkpoint) does not keep: the norm's output
    (both FP8 layouts where the GPU keeps both), FC1's output (2 x ffn, bf16) and the activation's output. 0 for
    models that answer for themselves."""
    if _answers_for_itself(args):
        return 0.0
    d, f, low = args.dim, args.ffn_dim, 1 if fp8 else 2
    return low * d * (2 if fp8 and fp8_transposes else 1) + 4 * f + low * f


def _mlp_forward_share(args) -> float:
    """FC1's share of a block's linear-layer FLOPs (attention's left out): what mode mlp runs again of a forward."""
    if _answers_for_itself(args):
        return 0.0
    d, f, kv = args.dim, args.ffn_dim, args.n_kv_heads * args.head_dim
    return 4 * d * f / (2 * d * (d + 2 * kv) + 2 * d * d + 6 * d * f)


@dataclass
class _Model:
    """What the plan needs of the model: built on the meta device, its FP8 weights and its FSDP units."""
    spec: object
    args: object
    model: object
    params: dict  # name -> parameter
    fp8: set  # names of the parameters that are FP8 (fp8.params)
    units: list  # FSDP units, each a list of modules
    unit_bytes: list  # each unit's gathered bytes (FP8 weights as FP8, the rest bf16)
    unit_grads: list  # each unit's unsharded bf16 gradient bytes
    names: dict  # id(parameter) -> name
    blocks: dict  # id(block module) -> its layer index

    @property
    def n_fp8(self) -> int:
        return sum(self.params[n].numel() for n in self.fp8)

    @property
    def n_block_matrices(self) -> int:
        """The blocks' 2-D weights: those whose gradients TE's GEMMs write (model.fuse_wgrad_accumulation)."""
        return sum(p.numel() for b in self.model.layers.values() for p in b.parameters() if p.dim() == 2)

    @property
    def n_other(self) -> int:
        return sum(p.numel() for n, p in self.params.items() if n not in self.fp8)

    def keeps_gathered(self, unit: list, mode: str, every_n: int) -> bool:
        """A unit of blocks with FP8 weights that activation checkpointing (`mode`, `every_n`) recomputes
        (parallel/wrappers.py's choice): FSDP keeps its gathered weights from its forward to its backward
        (FP8Policy.keeps_gathered)."""
        from titan_te.parallel.wrappers import recomputed

        return all(id(m) in self.blocks and recomputed(self.blocks[id(m)], mode, every_n)
                   and any(self.names[id(p)] in self.fp8 for p in m.parameters()) for m in unit)


def _build_model(cfg, vocab: int) -> _Model:
    import torch

    from titan_te.data.tokenizers import padded_vocab
    from titan_te.models import MODELS

    spec = MODELS.get(cfg.model.name)
    args = spec.args_for(cfg.model.flavor, padded_vocab(vocab), cfg.training.seq_len, cfg.model.n_layers)
    with torch.device("meta"):
        model = spec.build(args, "torch")
    params = dict(model.named_parameters())
    fp8 = {n for n, p in params.items() if _is_fp8(n, p, cfg, args.n_layers)}
    names = {id(p): n for n, p in params.items()}
    units = [u if isinstance(u, list) else [u] for u in spec.fsdp_units(model)]
    unit_bytes = [sum(p.numel() * (1 if names[id(p)] in fp8 else 2) for m in u for p in m.parameters()) for u in units]
    unit_grads = [sum(p.numel() * 2 for m in u for p in m.parameters()) for u in units]
    blocks = {id(b): int(k) for k, b in model.layers.items()}
    return _Model(spec, args, model, params, fp8, units, unit_bytes, unit_grads, names, blocks)


def _is_fp8(name: str, p, cfg, n_layers: int) -> bool:
    """With fp8.params, the 2-D weights of the blocks that run in FP8 are FP8."""
    from titan_te.te.policy import fp8_block

    if not cfg.fp8.params or p.ndim != 2 or not name.startswith("layers."):
        return False
    return fp8_block(cfg.fp8, int(name.split(".")[1]), n_layers)


def _n_recomputed(n_layers: int, every_n: int) -> int:
    """How many blocks every_n / mlp recompute: block 0 and every N-th after it (parallel/wrappers.py's choice)."""
    from titan_te.parallel.wrappers import recomputed

    return sum(recomputed(i, "every_n", every_n) for i in range(n_layers))


def _activations(cfg, m: _Model, vocab: int, tokens: int, fp8_transposes: bool, every_n: int) -> tuple[dict, float]:
    """Bytes of activations at the step's peak per activation-checkpoint mode with `every_n` (what the blocks keep
    to the head, plus what a recomputing block holds again beyond the head's logits), and the output head's bytes."""
    args = m.args
    per_layer = activation_bytes_per_token_layer(args, cfg.fp8.enable, fp8_transposes) * tokens
    layer_input = 2 * args.dim * tokens
    mlp_part = mlp_recomputed_bytes_per_token_layer(args, cfg.fp8.enable, fp8_transposes) * tokens
    n, n_recomputed = args.n_layers, _n_recomputed(args.n_layers, every_n)
    rows = getattr(args, "vocab_size", vocab)
    if cfg.model.fused_loss and m.spec.computes_loss:  # one chunk of bf16 logits, the hidden states' and the
        logits = min(CHUNK_LOGITS_BYTES, tokens * rows * 2)  # weight's FP32 gradient, kept from the forward
        head = logits + tokens * args.dim * 2 + rows * args.dim * 4
    else:  # FP32 logits, their gradient, their bf16 twin
        logits = tokens * rows * (4 + 4)
        head = logits + tokens * rows * 2
    # what the blocks keep to the head (the recomputing ones their input, or all but their MLP's part), and what a
    # recomputing block holds again in its backward, when the head's logits are gone: the peak is at the head
    # unless that part is the larger
    kept = {"none": n * per_layer, "mlp": n * per_layer - n_recomputed * mlp_part,
            "every_n": (n - n_recomputed) * per_layer + n_recomputed * layer_input, "full": n * layer_input}
    held = {"none": 0, "mlp": mlp_part if n_recomputed else 0, "every_n": per_layer if n_recomputed else 0,
            "full": per_layer}
    return {mode: kept[mode] + max(0.0, held[mode] - logits) for mode in AC_MODES}, head


@dataclass
class _RankMemory:
    """One rank's memory apart from activation checkpointing's choice, and its peak for any choice."""
    m: _Model
    card: GPU
    parallel: object  # the data parallelism's spec
    rep: int  # replicas
    shard: int  # FSDP's shard degree
    div: int  # what the weights, gradients and state are divided by (the shard degree where it shards them)
    gathers: bool  # FSDP moves weights and gradients between the shards
    transposes: float  # TE's transposed FP8 copies of the weights used in place
    weights: float
    grads: float
    state: float
    state_full: float  # unsharded: what a checkpoint holds
    transient: float  # FSDP's gathered units in flight in the backward
    at_head: float  # beyond the activations, at the head's forward
    in_backward: float  # beyond the activations, in the backward's first units
    grad_accum: int  # micro-batches a step
    head: float
    cfg: object
    vocab: int
    tokens: int  # one micro-batch's

    def activations(self, every_n: int) -> dict:
        """Bytes of activations at the peak per activation-checkpoint mode with `every_n` (_activations)."""
        return _activations(self.cfg, self.m, self.vocab, self.tokens, self.card.fp8_transpose, every_n)[0]

    def kept_gathered(self, mode: str, every_n: int) -> float:
        """Blocks that stay gathered from their forward to their backward (recomputed FP8 blocks): whole copies."""
        return 0 if not self.gathers else sum(
            b for u, b in zip(self.m.units, self.m.unit_bytes) if self.m.keeps_gathered(u, mode, every_n))

    def peak(self, mode: str, every_n: int) -> float:
        """At the start of the backward (every activation, the kept gathered blocks, and the larger of what the
        head's forward holds and what the first units of the backward hold: _rank_memory) or in the optimizer
        step (every gradient, no activation): in one micro-batch gradients replace activations block by block as
        the backward goes. With fp8.backward_transposes the FP8 weights' transposes are made in the backward and
        freed by the optimizer: they count in the optimizer step, and from a step's second micro-batch on at the
        start of its backward too."""
        acts = self.activations(every_n)[mode]
        late = self.late_transposes
        held_late = late if self.grad_accum > 1 else 0
        return self.weights - late + self.state + WORKSPACE + max(
            acts + self.kept_gathered(mode, every_n) + held_late + max(self.at_head, self.in_backward),
            self.grads + late)

    @property
    def late_transposes(self) -> float:
        """The FP8 transposes' bytes that fp8.backward_transposes leaves out of the forward (0 without it)."""
        fp8 = self.cfg.fp8
        return self.transposes if fp8.enable and fp8.params and fp8.backward_transposes else 0

    def fits(self, peak: float) -> bool:
        return peak <= self.card.memory * (1 - ALLOCATOR_SLACK)


def _rank_memory(cfg, m: _Model, world: int, card: GPU, vocab: int) -> _RankMemory:
    import torch

    from titan_te import config as config_mod
    from titan_te.optim import OPTIMIZERS
    from titan_te.parallel import select
    from titan_te.train_utils import global_batch_plan

    rep, shard = config_mod.dp_degrees(cfg.parallelism, world)
    parallel = select(cfg.parallelism, world)
    div = shard if parallel.shards_params else 1
    gathers = parallel.shards_params and div > 1
    n_fp8, n_other = m.n_fp8, m.n_other
    opt = OPTIMIZERS.get(cfg.optimizer.name)
    state_full = n_fp8 * opt.state_bytes(cfg.optimizer, True) + n_other * opt.state_bytes(cfg.optimizer, False)
    # weights used in place (no FSDP gathers) keep TE's transposed FP8 copy on GPUs that need one; FSDP's
    # gathered copies are counted in `transient` (not measured for its shards)
    transposes = n_fp8 if card.fp8_transpose and not gathers else 0
    weights = (n_fp8 * 1 + n_other * 4) / div + transposes
    # TE writes the block matrices' gradients in place in model.wgrad_dtype where nothing reduces them
    in_place = cfg.model.fuse_wgrad_accumulation and parallel.local_grads
    wgrad = getattr(torch, cfg.model.wgrad_dtype).itemsize if in_place else 4
    grads = ((n_fp8 + n_other - m.n_block_matrices) * 4 + m.n_block_matrices * wgrad) / div
    # FSDP gathers a unit (bf16, FP8 weights as FP8) before using it and keeps the next one prefetched; in the
    # backward the unit's unsharded bf16 gradients are copied into the reduce-scatter's input (in its dtype)
    reduce_bytes = getattr(torch, cfg.training.mixed_precision_reduce).itemsize
    transient = (2 * max(m.unit_bytes) + max(m.unit_grads) * (1 + reduce_bytes / 2)) if gathers else 0
    t = cfg.training
    tokens = t.local_batch_size * t.seq_len  # one micro-batch
    head = _activations(cfg, m, vocab, tokens, card.fp8_transpose, 1)[1]
    block_grads = max(m.unit_grads) * wgrad / 2 / div if m.unit_grads else 0  # FP32 (or wgrad's), sharded
    grad_accum = global_batch_plan(t, rep * shard, None)[0]  # as the trainer derives it
    # at the start of the backward the first unit's gradients are new; from a step's second micro-batch on, the
    # gradients of the earlier ones are all held through its forward and backward (and, where FSDP shards them,
    # beside the unit's own waiting for its reduce-scatter)
    held_grads = (grads + (block_grads if gathers else 0)) if grad_accum > 1 else block_grads
    if gathers:
        # two moments, the larger one the peak: the head's forward (its buffers, the last unit gathered, which
        # FSDP keeps so to the backward, and the earlier micro-batches' gradients) and the backward's first units
        # (the units in flight, the gradients held then)
        at_head = head + m.unit_bytes[-1] + (grads if grad_accum > 1 else 0)
        in_backward = transient + held_grads
    else:
        at_head, in_backward = head + held_grads, 0.0
    return _RankMemory(m, card, parallel, rep, shard, div, gathers, transposes, weights, grads, state_full / div,
                       state_full, transient, at_head, in_backward, grad_accum, head, cfg, vocab, tokens)


def recomputed_share(args, mode: str, every_n: int) -> float:
    """The share of the forward's linear-layer FLOPs that activation checkpointing runs again."""
    every = _n_recomputed(args.n_layers, every_n) / args.n_layers
    return {"none": 0.0, "full": 1.0, "every_n": every, "mlp": _mlp_forward_share(args) * every}[mode]


@dataclass(frozen=True)
class Recomputation:
    """One activation-checkpointing choice with its planned peak per rank."""
    mode: str
    every_n: int
    peak: float
    fits: bool
    share: float  # of the forward, run again

    def describe(self) -> str:
        n = self.every_n
        what = {"none": "nothing recomputed", "full": "every block recomputed",
                "every_n": f"one block in {n} recomputed",
                "mlp": "every block's MLP recomputed" if n == 1 else f"the MLP of one block in {n} recomputed"}
        return f"{self.mode}{f', every_n = {n}' if self.mode in ('every_n', 'mlp') else ''}: {what[self.mode]}"


def _candidates(recomputes_mlp: bool) -> list[tuple[str, int]]:
    """What mode auto chooses from: nothing, the MLPs of one block in 8/4/2/1 (backends whose blocks recompute
    their MLP apart), one whole block in 8/4/2, every block."""
    mlp = [("mlp", n) for n in (8, 4, 2, 1)] if recomputes_mlp else []
    return [("none", 1), *mlp, *[("every_n", n) for n in (8, 4, 2)], ("full", 1)]


def _lightest(mem: _RankMemory, recomputes_mlp: bool) -> Recomputation:
    """Of the candidates whose planned peak fits the card (less the allocator's slack), the one that recomputes the
    least of the forward; full where none fits (its `fits` then says so)."""
    options = [Recomputation(mode, n, peak, mem.fits(peak), recomputed_share(mem.m.args, mode, n))
               for mode, n in _candidates(recomputes_mlp) for peak in [mem.peak(mode, n)]]
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: o.share) if fitting else options[-1]


def lightest_recomputation(cfg, world: int, card: GPU, vocab: int, recomputes_mlp: bool) -> tuple[Recomputation, float]:
    """activation_checkpoint.mode = auto: the lightest recomputation that fits `card` on each of `world` ranks, and
    the peak without any."""
    mem = _rank_memory(cfg, _build_model(cfg, vocab), world, card, vocab)
    return _lightest(mem, recomputes_mlp), mem.peak("none", 1)


def gpu_of(memory: int, capability: tuple[int, int]) -> GPU:
    """The card a run is on, for the memory plan: its memory (a rank's share of it) and whether its FP8 GEMMs need
    TE's transposed copies (before Blackwell, compute capability 10)."""
    return GPU(memory, 989e12, fp8_transpose=capability[0] < 10)


def _plans_mlp(cfg) -> bool:
    """Whether the planned run's blocks can recompute their MLP apart: its backend's (auto: te where the family has
    te blocks, as on a GPU with Transformer Engine)."""
    from titan_te.layers import BACKENDS
    from titan_te.models import MODELS

    backends = MODELS.get(cfg.model.name).backends or ("te",)
    backend = cfg.model.backend if cfg.model.backend != "auto" else ("te" if "te" in backends else "torch")
    return BACKENDS.get(backend).recomputes_mlp


def make_plan(cfg, ngpu: int, nnodes: int, gpu: str, vocab: int, nvlink: float = NVLINK_GBS, ib: float = IB_GBS,
              breakdown: dict | None = None) -> Plan:
    from dataclasses import replace

    world = ngpu * nnodes
    m = _build_model(cfg, vocab)
    n_fp8, n_other = m.n_fp8, m.n_other
    card = GPUS[gpu]
    mem = _rank_memory(cfg, m, world, card, vocab)
    weights, grads, state, transient, head = mem.weights, mem.grads, mem.state, mem.transient, mem.head
    parallel, rep, shard, div = mem.parallel, mem.rep, mem.shard, mem.div
    gathers, transposes = mem.gathers, mem.transposes
    t, acfg = cfg.training, cfg.activation_checkpoint
    lightest = _lightest(mem, _plans_mlp(cfg))
    configured = acfg.mode
    if acfg.mode == "auto":  # the rest of the plan is for what auto chooses on this card
        acfg = replace(acfg, mode=lightest.mode, every_n=lightest.every_n)
    acts = mem.activations(acfg.every_n)
    plan = Plan()
    memory, peak_flops = card.memory, card.peak_flops
    for mode in AC_MODES:
        plan.kept_gathered[mode] = mem.kept_gathered(mode, acfg.every_n)
        plan.peak[mode] = mem.peak(mode, acfg.every_n)
        plan.fits[mode] = mem.fits(plan.peak[mode])
    # checkpoint: weights as stored (FP8 1 byte, others FP32) + optimizer state (what DCP writes)
    plan.checkpoint_bytes = (n_fp8 * 1 + n_other * 4) + mem.state_full
    # communication per rank per step: FSDP gathers every unit in the forward, and in the backward again each
    # unit that resharded after its forward (reshard_after_forward: all but the last, which the backward needs
    # first, and but a recomputed block with FP8 weights, which keeps its gathered weights); it reduce-scatters
    # FP32 gradients once; (shard-1)/shard of each travels
    regathered = sum(b for i, (u, b) in enumerate(zip(m.units, m.unit_bytes))
                     if cfg.parallelism.reshard_after_forward and i < len(m.units) - 1
                     and not m.keeps_gathered(u, acfg.mode, acfg.every_n))
    if gathers:
        plan.gather_bytes = (n_fp8 * 1 + n_other * 2 + regathered) * (div - 1) / div
        plan.scatter_bytes = (n_fp8 + n_other) * 4 * (div - 1) / div
    replicate_bytes = 0.0
    group = rep if rep > 1 else (world if parallel.multi_process and not parallel.shards_params else 1)
    if group > 1:  # an all-reduce of the (sharded) FP32 gradients over the replicas (HSDP's, DDP's)
        replicate_bytes = 2 * (n_fp8 + n_other) * 4 / div * (group - 1) / group
    shard_link = nvlink if div <= ngpu else ib  # the shard group within one node: NVLink, else InfiniBand
    comm_s = (plan.gather_bytes + plan.scatter_bytes) / (shard_link * 1e9)
    comm_s += replicate_bytes / ((ib if nnodes > 1 else nvlink) * 1e9)
    step_tokens = mem.tokens * mem.grad_accum
    # recomputation: a checkpointed block runs its forward twice (the forward is a third of its FLOPs)
    recomputed = recomputed_share(m.args, acfg.mode, acfg.every_n)
    compute_s = _compute_s(breakdown, step_tokens, m.args, t.seq_len, peak_flops, div) * (1 + recomputed / 3)
    exposed = max(m.unit_bytes) / (shard_link * 1e9) if gathers else 0.0
    plan.step_s = {"no overlap": compute_s + comm_s, "overlap": max(compute_s, comm_s) + exposed}
    plan.tokens_per_s = {k: step_tokens / v for k, v in plan.step_s.items()}
    measured = "measured breakdown" if breakdown else f"FLOPs at {ASSUMED_MFU:.0%} MFU"
    plan.rows = [
        ("world", f"{world} ranks ({nnodes} node(s) x {ngpu}); {parallel.name}, replicate {rep} x shard {shard}"),
        ("parameters", f"{(n_fp8 + n_other) / 1e9:,.2f} B ({n_fp8 / 1e9:,.2f} B in FP8, {n_other / 1e9:,.2f} B "
                       f"higher precision)"),
        ("weights / rank", f"{_gib(weights)} (FP8 {_gib(n_fp8 / div)}"
                           + (f", their transposes {_gib(transposes)}" if transposes else "")
                           + (" made in the backward" if mem.late_transposes else "")
                           + f", FP32 {_gib(n_other * 4 / div)})"),
        ("gradients / rank", _gib(grads)),
        ("optimizer state / rank", f"{_gib(state)} ({cfg.optimizer.name}, moments {cfg.optimizer.moment_dtype})"),
        ("FSDP gathers in flight", _gib(transient)),
        ("output head", _gib(head)),
        ("workspaces (allowance)", _gib(WORKSPACE)),
        *[(f"activations, AC {mode}", _gib(acts[mode])) for mode in AC_MODES],
        *[(f"kept gathered, AC {mode}", _gib(plan.kept_gathered[mode])) for mode in AC_MODES
          if plan.kept_gathered[mode]],
        *[(f"peak / rank, AC {mode}", f"{_gib(plan.peak[mode])} of {_gib(memory)} on a {gpu}: "
                                      f"{_verdict(plan, mode, memory)}") for mode in AC_MODES],
        ("activation checkpointing", _ac_row(configured, lightest)),
        ("one checkpoint", f"{plan.checkpoint_bytes / 1e9:,.1f} GB ({plan.checkpoint_bytes / world / 1e9:,.2f} GB "
                           f"per rank)"),
        ("all-gather / rank / step", f"{plan.gather_bytes / 1e9:,.2f} GB"),
        ("reduce-scatter / rank / step", f"{plan.scatter_bytes / 1e9:,.2f} GB"),
        ("replica all-reduce / step", f"{replicate_bytes / 1e9:,.2f} GB"),
        ("compute / step", f"{compute_s * 1e3:,.0f} ms ({measured}"
                           f"{f', AC {acfg.mode} recomputes' if recomputed else ''})"),
        ("communication / step", f"{comm_s * 1e3:,.0f} ms (NVLink {nvlink:g} GB/s, InfiniBand {ib:g} GB/s per GPU)"),
        *[(f"step, {k}", f"{v * 1e3:,.0f} ms = {plan.tokens_per_s[k]:,.0f} tokens/s per GPU")
          for k, v in plan.step_s.items()],
    ]
    return plan


def _ac_row(configured: str, lightest: Recomputation) -> str:
    if configured == "auto":  # the plan's other rows are for this choice
        return f"auto (configured) chooses {lightest.describe()}{'' if lightest.fits else ' (nothing fits)'}"
    return f"{configured} (configured); the lightest that fits: {lightest.describe() if lightest.fits else 'none'}"


def _verdict(plan: Plan, mode: str, memory: float) -> str:
    if plan.fits[mode]:
        return "fits"
    if plan.peak[mode] <= memory:
        return (f"tight (within {ALLOCATOR_SLACK:.0%} of the card, where the allocator's free pieces may not hold a "
                f"large buffer: may run out of memory)")
    return "does NOT fit"


def _compute_s(breakdown: dict | None, step_tokens: int, args, seq_len: int, peak: float, shard: int) -> float:
    """A measured one-GPU step (ms by category) scaled to this rank's tokens, its optimizer to its shard."""
    if breakdown:
        parts, tokens = breakdown["parts"], breakdown["tokens"] / breakdown.get("gpus", 1)  # one GPU's tokens
        optimizer_s = parts.get("optimizer", 0.0) / 1e3
        other_s = breakdown["step_s"] - optimizer_s
        return other_s * step_tokens / tokens + optimizer_s / shard
    return step_tokens * args.flops_per_token(seq_len) / (ASSUMED_MFU * peak)


def _check_breakdown(run: dict) -> None:
    """What _compute_s reads of a train_bench run: its step time, tokens and the step's parts in ms."""
    numbers = [run["step_s"], run["tokens"], run.get("gpus", 1), *run["parts"].values()]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in numbers) \
            or run["step_s"] <= 0 or run["tokens"] <= 0 or run.get("gpus", 1) <= 0:
        raise ValueError("step_s, tokens and gpus must be numbers > 0, the parts' milliseconds >= 0")


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def render(plan: Plan) -> str:
    width = max(len(k) for k, _ in plan.rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in plan.rows) + "\n"


def main(argv: list[str] | None = None, exits_after: bool = False) -> int:
    from titan_te.tool_cli import run_tool

    return run_tool("plan error", lambda: _main(sys.argv[1:] if argv is None else argv), exits_after)


def _main(argv: list[str]) -> int:
    from titan_te import config as config_mod
    from titan_te.data import TOKENIZERS
    from titan_te.tool_cli import OneLineParser, UsageError

    ap = OneLineParser(prog="python -m titan_te.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a TOML file or preset name (as train.py)")
    ap.add_argument("--ngpu", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    ap.add_argument("--nvlink_gbs", type=float, default=NVLINK_GBS, help="GB/s per GPU and direction in a node")
    ap.add_argument("--ib_gbs", type=float, default=IB_GBS, help="GB/s per GPU and direction between nodes")
    ap.add_argument("--breakdown", default="", help="a run of benchmarks/train_bench.py --json (its step)")
    ap.add_argument("--breakdown_run", default="", help="which run of that file (default: the first)")
    a, overrides = ap.parse_known_args(argv)
    if a.ngpu < 1 or a.nnodes < 1:
        raise UsageError("--ngpu and --nnodes must be >= 1")
    for flag, value in (("--nvlink_gbs", a.nvlink_gbs), ("--ib_gbs", a.ib_gbs)):
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"{flag} must be a bandwidth > 0 in GB/s, got {value}")
    import os

    os.environ["WORLD_SIZE"] = str(a.ngpu * a.nnodes)  # validation checks the batch against this world
    cfg, _ = config_mod.load(([f"--config={a.config}"] if a.config else []) + overrides, hardware=False)
    breakdown = None
    if a.breakdown:
        try:
            runs = json.loads(Path(a.breakdown).read_text())
            breakdown = runs[a.breakdown_run] if a.breakdown_run else next(iter(runs.values()))
            _check_breakdown(breakdown)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration) as e:
            raise UsageError(f"--breakdown {a.breakdown}: not a train_bench --json file with that run "
                             f"({type(e).__name__}: {e})") from None
    vocab = TOKENIZERS.get(cfg.data.tokenizer)(cfg.data).vocab_size
    sys.stdout.write(render(make_plan(cfg, a.ngpu, a.nnodes, a.gpu, vocab, a.nvlink_gbs, a.ib_gbs, breakdown)))
    return 0


if __name__ == "__main__":
    sys.exit(main(exits_after=True))
