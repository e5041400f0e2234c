"""End-to-end training speed of the presets beside a torchtitan-style peer, on one GPU, in one run.

    python benchmarks/train_bench.py                          # 1B and 8B: presets and peers
    python benchmarks/train_bench.py --runs 1b_fp8,1b_peer    # a subset
    python benchmarks/train_bench.py --runs 1b_fp8,1b_peer --n_layers 2 --steps 3   # a quick look
    python benchmarks/train_bench.py --runs 8b_fp8,8b_peer --ngpu 8 --json bench.json  # and on 8 GPUs

Every run is a fresh process (its own CUDA context and memory peak) at the preset's shapes: vocabulary
128,256, seq 8192, the presets' batch: 4 (1B), 2 (8B; the peer at 1 and, `8b_peer_b2`, at 2). The presets run
through the Trainer and its real training loop (`Trainer.train`, data loader included, checkpoints and
TensorBoard off); the peer is
benchmarks/peer_llama.py on random tokens. After --warmup steps, --steps steps are timed between two
device synchronizations, less the fixed work of a loop call that trains no step (the trainer's end of a
loop: the finiteness check of weights and optimizer state that also precedes every save; the peer has
none), which the run's line prints as "per call"; then --profile_steps more are traced with
torch.profiler, inside one training loop (not its first or last step), and the GPU time they queued is
split by kernel name into categories, with `idle` the part of their GPU window in which no kernel or copy ran.

tok/s, TFLOP/s (6 x parameters + attention, the trainer's formula, the same for every run; and by
Megatron's count, which halves causal attention, to compare with its tables), MFU
against the dense bf16 peak (989 TFLOP/s on an H200), the peak of allocated memory, and the ratio to
the peer of the same size. A `<name>_before` run takes the code from --before (a checkout of an
older commit) to compare a change in the same session.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"1b": ("llama3_1b_fp8", "1B", 4), "8b": ("llama_fp8", "8B", 1)}  # preset, flavor, the peer's batch
VOCAB, SEQ = 128256, 8192  # the flavors' vocabulary (the byte tokenizer's ids lie within it)
PEAK = 989e12


def _batch2_recomputing_every(n: int, mode: str = "every_n") -> list[str]:
    return ["--training.local_batch_size=2", f"--activation_checkpoint.mode={mode}",
            f"--activation_checkpoint.every_n={n}"]


BF16_WGRAD = "--model.wgrad_dtype=bfloat16"
LATE_TRANSPOSES = "--fp8.backward_transposes=true"
# run name -> (kind, size, preset overrides or peer options)
RUNS = {
    "1b_fp8": ("preset", "1b", []),  # on one GPU the FP8 presets train without FSDP (unsharded_one_rank)
    "1b_fp8_before": ("before", "1b", []),
    "1b_fp8_fsdp": ("preset", "1b", ["--parallelism.unsharded_one_rank=false"]),
    "8b_fp8_fsdp": ("preset", "8b", ["--parallelism.unsharded_one_rank=false"]),
    # FP32 logits through the unfused head, which runs in bf16 (the fused one alone has fp8.head)
    "1b_fp8_full_logits": ("preset", "1b", ["--model.fused_loss=false", "--fp8.head=off"]),
    # the 1B preset's output head is FP8 (fp8.head = "all"); these keep it in bf16, or only its dgrad in FP8
    "1b_fp8_head_off": ("preset", "1b", ["--fp8.head=off"]),
    "1b_fp8_head_dgrad": ("preset", "1b", ["--fp8.head=dgrad"]),
    "8b_fp8_head_all": ("preset", "8b", ["--fp8.head=all"]),
    # the 8B head's logits (so the loss) in bf16 and only its gradient into the model in FP8: all of it in FP8 cost
    # loss at 8B (README)
    "8b_fp8_head_dgrad": ("preset", "8b", ["--fp8.head=dgrad"]),
    # FSDP with the blocks as the only units (the root holds embedding, norm and head), beside *_fsdp
    "1b_fp8_blocks_plan": ("blocks_plan", "1b", ["--parallelism.unsharded_one_rank=false"]),
    "8b_fp8_blocks_plan": ("blocks_plan", "8b", ["--parallelism.unsharded_one_rank=false"]),
    "1b_bf16": ("preset", "1b", ["--fp8.enable=false"]),
    "1b_peer": ("peer", "1b", {"float8": True, "bf16_state": False}),
    "1b_peer_bf16": ("peer", "1b", {"float8": False, "bf16_state": False}),
    "8b_fp8": ("preset", "8b", []),  # two sequences a GPU, activation_checkpoint.mode = auto (one H200: mlp, every_n 4)
    # the 8B preset until 2026-12-07: one sequence, nothing recomputed
    "8b_fp8_b1": ("preset", "8b", ["--training.local_batch_size=1", "--activation_checkpoint.mode=none"]),
    "8b_fp8_before": ("before", "8b", []),
    "8b_fp8_attention": ("preset", "8b", ["--fp8.attention=true"]),
    # attention in an installed FlashAttention package (flash-attn-4's CuTe kernels on Hopper) instead of cuDNN's
    "1b_fp8_flash": ("preset", "1b", ["--model.attention_kernel=flash"]),
    "8b_fp8_flash": ("preset", "8b", ["--model.attention_kernel=flash"]),
    # FP8 weights' transposes derived in the backward only: 6.5 GiB off the 8B's peak, so that mode auto recomputes
    # the MLP of one block in 8 instead of 4 on one H200
    "1b_fp8_backward_transposes": ("preset", "1b", [LATE_TRANSPOSES]),
    "8b_fp8_backward_transposes": ("preset", "8b", [LATE_TRANSPOSES]),
    # ... and nothing recomputed: planned 134.4 GiB, within the planner's 5% of an H200's 140.4 (tight), which the
    # allocator's expandable segments (train.py) may hold
    "8b_fp8_b2_backward_transposes": ("preset", "8b", ["--training.local_batch_size=2",
                                                       "--activation_checkpoint.mode=none", LATE_TRANSPOSES]),
    # the 8B's unadopted levers together: FA4, the head's dgrad in FP8, bf16 weight gradients, late transposes
    "8b_fp8_levers": ("preset", "8b", ["--model.attention_kernel=flash", "--fp8.head=dgrad", BF16_WGRAD,
                                       LATE_TRANSPOSES]),
    # the 1B's: FA4 and bf16 weight gradients (its head is all FP8 already; its memory needs no late transposes)
    "1b_fp8_levers": ("preset", "1b", ["--model.attention_kernel=flash", BF16_WGRAD]),
    # FP8 current scaling (what Megatron-Bridge publishes its 8B figure with) beside the presets' delayed
    "1b_fp8_current": ("preset", "1b", ["--fp8.recipe=current"]),
    "8b_fp8_current": ("preset", "8b", ["--fp8.recipe=current"]),
    # batch 2 at 8B (the preset's): larger GEMMs and half the optimizer steps per token; without recomputation the
    # planner puts its peak at 140.9 GiB, over the H200's 140.4, so also with every 4th or 8th block recomputed to
    # make room, or only their MLPs' norm, FC1 and SwiGLU (mode mlp: 131.3 and 136.2 GiB)
    "8b_fp8_b2": ("preset", "8b", ["--training.local_batch_size=2", "--activation_checkpoint.mode=none"]),
    "8b_fp8_b2_every4": ("preset", "8b", _batch2_recomputing_every(4)),
    "8b_fp8_b2_every8": ("preset", "8b", _batch2_recomputing_every(8)),
    "8b_fp8_b2_mlp4": ("preset", "8b", _batch2_recomputing_every(4, "mlp")),
    "8b_fp8_b2_mlp8": ("preset", "8b", _batch2_recomputing_every(8, "mlp")),
    "8b_fp8_b2_mlp4_head_all": ("preset", "8b", _batch2_recomputing_every(4, "mlp") + ["--fp8.head=all"]),
    # the presets fuse SwiGLU's derivative with its FP8 cast and transpose (fp8.fused_swiglu); these run TE's two
    # kernels instead
    "1b_fp8_tes_swiglu": ("preset", "1b", ["--fp8.fused_swiglu=false"]),
    "8b_fp8_tes_swiglu": ("preset", "8b", ["--fp8.fused_swiglu=false"]),
    # on one rank TE's GEMMs write the weight gradients in FP32 in place (model.fuse_wgrad_accumulation); these
    # take autograd's bf16 gradients and cast them instead
    "1b_fp8_autograd_wgrad": ("preset", "1b", ["--model.fuse_wgrad_accumulation=false"]),
    "8b_fp8_autograd_wgrad": ("preset", "8b", ["--model.fuse_wgrad_accumulation=false"]),
    # ... or in bf16 (model.wgrad_dtype): half the bytes the optimizer and the gradient norm read, and 1 GiB off the
    # 8B's batch-2 peak (planner: 139.9 GiB without recomputation, tight; 135.2 with every 8th MLP recomputed)
    "1b_fp8_bf16_wgrad": ("preset", "1b", [BF16_WGRAD]),
    "8b_fp8_bf16_wgrad": ("preset", "8b", [BF16_WGRAD]),
    "8b_fp8_b2_bf16_wgrad": ("preset", "8b", ["--training.local_batch_size=2", "--activation_checkpoint.mode=none",
                                               BF16_WGRAD]),
    "8b_fp8_b2_mlp4_bf16_wgrad": ("preset", "8b", _batch2_recomputing_every(4, "mlp") + [BF16_WGRAD]),
    "8b_fp8_b2_mlp8_bf16_wgrad": ("preset", "8b", _batch2_recomputing_every(8, "mlp") + [BF16_WGRAD]),
    "8b_peer": ("peer", "8b", {"float8": True, "bf16_state": True}),
    "8b_peer_b2": ("peer", "8b", {"float8": True, "bf16_state": True, "batch": 2}),  # the 8B preset's batch
    # gradient accumulation (training.global_batch_size): 4 sequences per optimizer step, one at a time, as
    # Megatron's published 8B runs take several micro-batches a step; beside the peer accumulating as many. Every
    # FP32 gradient is then held through the later micro-batches: the whole 8B plans 138.3 GiB on an H200 (tight),
    # so run them with --n_layers 16 on one GPU (README: Planning many GPUs)
    "8b_fp8_ga4": ("preset", "8b", ["--training.global_batch_size=4", "--training.local_batch_size=1",
                                    "--activation_checkpoint.mode=none"]),
    "8b_peer_ga4": ("peer", "8b", {"float8": True, "bf16_state": True, "accum": 4}),
}
DEFAULT_RUNS = "1b_fp8,1b_fp8_fsdp,1b_peer,8b_fp8,8b_fp8_fsdp,8b_peer,8b_peer_b2"
# kernel-name fragments per category, first match wins (attention before GEMM: fused attention kernels
# carry GEMM-like names)
CATEGORIES = [
    ("attention", ("flash", "fmha", "sdpa", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "matmul", "sm90_")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm", "l2norm")),
    ("cast/transpose", ("cast_", "_cast", "transpose", "quantize", "amax", "fp8", "float8", "scale", "direct_copy",
                        "bfloat16_copy")),
    ("copies/comm", ("memcpy", "memset", "nccl", "chunk_cat", "split_with_sizes", "catarray", "copy")),
]
COLUMNS = [c for c, _ in CATEGORIES] + ["other", "idle"]


def category(name: str, cat: str) -> str:
    low = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies/comm"
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return "other"


LAUNCHES = ("cuda_runtime", "cuda_driver")  # trace categories of the host calls that queue GPU work


class NoBreakdown(Exception):
    """A trace that holds no steady steps to split."""


def breakdown(trace: Path) -> dict:
    """ms per step per category, idle ms and busy % of the steady steps of a chrome trace.

    The steps are torch.profiler's `ProfilerStep#N` ranges on the host; a kernel or copy belongs to the step
    whose range queued it (matched by its correlation id). The last traced step is left out: it only keeps
    the loop running until the GPU has finished the counted ones (the trainer reads a step's values during the
    next one). The counted steps' GPU window runs from their first kernel's start to their last kernel's end,
    so a loop's start and end (the host queuing the first kernels, a final synchronization) are not in it.
    Kineto writes each ProfilerStep range twice, on the host and (category gpu_user_annotation) on the GPU
    row; only the host's count."""
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events  # the host's ranges: the GPU row repeats them
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                   and not str(e.get("cat", "")).startswith("gpu_"))[:-1]
    if not steps:
        raise NoBreakdown(f"{trace}: fewer than two ProfilerStep ranges; trace at least --profile_steps=1 plus one")
    queued = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}

    def counted(e) -> bool:
        at = queued.get(e.get("args", {}).get("correlation"))
        return at is not None and any(a <= at < b for a, b in steps)

    on_gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = [e for e in on_gpu if counted(e)]
    n = len(steps)
    if not on_gpu:  # a run on the CPU: nothing to split
        return {**{c: 0.0 for c in COLUMNS}, "traced_ms": sum(b - a for a, b in steps) / n / 1e3, "busy_pct": 0.0}
    if not gpu:
        raise NoBreakdown(f"{trace}: none of the GPU work in the trace was queued by the traced steps")
    per = {c: 0.0 for c in COLUMNS}
    spans = []
    for e in gpu:
        per[category(e.get("name", ""), e["cat"])] += e["dur"]
        spans.append((e["ts"], e["ts"] + e["dur"]))
    busy, end = 0.0, -1.0
    for a, b in sorted(spans):  # union of the intervals: several streams can overlap
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    per["idle"] = window - busy
    by_name: dict[str, float] = {}
    for e in gpu:
        by_name[e.get("name", "")] = by_name.get(e.get("name", ""), 0.0) + e["dur"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]:  # into the run's log
        print(f"  {us / n / 1e3:8.2f} ms  {category(name, 'kernel'):<15} {name[:150]}")
    chains = host_chains(events)
    print_callers(chains, gpu, n)
    print_idle(chains, queued, steps, gpu, n)
    out = {c: v / n / 1e3 for c, v in per.items()}
    out["traced_ms"] = window / n / 1e3
    out["busy_pct"] = 100.0 * busy / window
    return out


HOST_OPS = ("cpu_op", "user_annotation")  # trace categories of the host ranges a launch can lie in
TRACED_TO_HOST = ("cast/transpose", "copies/comm", "other")  # categories whose kernels print_callers explains


def host_chains(events: list) -> dict:
    """For each launch's correlation id: the host ops open around it on its thread, outermost first (the
    ProfilerStep range left out), each as 'name' or, for the innermost, 'name [input types and dims]' (traces
    recorded with record_shapes carry them)."""
    per_thread: dict = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in HOST_OPS and not str(e.get("name", "")).startswith("ProfilerStep#"):
            per_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], 0, e))
        elif e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            per_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], 1, e))
    chains = {}
    for items in per_thread.values():
        stack: list = []
        for ts, is_launch, e in sorted(items, key=lambda x: (x[0], x[1], -x[2].get("dur", 0))):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:
                stack.pop()
            if not is_launch:
                stack.append(e)
                continue
            names = [op["name"] for op in stack]
            if stack:
                args = stack[-1].get("args", {})
                shapes = ", ".join(f"{t} {d}" for t, d in zip(args.get("Input type", []), args.get("Input Dims", []))
                                   if d)
                names[-1] += f" [{shapes}]" if shapes else ""
            chains[e["args"]["correlation"]] = names
    return chains


def _chain(chains: dict, e: dict) -> str:
    """The innermost three host ops around the launch of GPU event `e`."""
    return " > ".join(chains.get(e.get("args", {}).get("correlation"), [])[-3:]) or "(no host op)"


def print_callers(chains: dict, gpu: list, n: int, kernels: int = 6, chains_each: int = 3) -> None:
    """Into the run's log: for the biggest kernels outside GEMM and attention, the host op chains that
    queued them (its innermost three ops) and their ms per step: where a copy or a cast comes from."""
    by_kernel: dict[str, dict[str, float]] = {}
    for e in gpu:
        name = e.get("name", "")
        if category(name, e["cat"]) not in TRACED_TO_HOST:
            continue
        chain = _chain(chains, e)
        per = by_kernel.setdefault(name, {})
        per[chain] = per.get(chain, 0.0) + e["dur"]
    top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1].values()))[:kernels]
    for name, per in top:
        print(f"  queued by, for {sum(per.values()) / n / 1e3:.2f} ms of {name[:100]}:")
        for chain, us in sorted(per.items(), key=lambda kv: -kv[1])[:chains_each]:
            print(f"      {us / n / 1e3:8.2f} ms  {chain[:300]}")


def print_idle(chains: dict, queued: dict, steps: list, gpu: list, n: int, top: int = 6,
               min_gap_us: float = 5.0) -> None:
    """Into the run's log: the idle time of the traced steps by what ended it, the host op chain that queued the
    GPU work after each gap, whether the host queued that work only after the GPU had run dry ("host-bound":
    the host was behind) or before ("queued earlier": the GPU waited on something else, a stream or a copy), and
    where in its step (host time, 0% its start) that work was queued, on average."""
    by_cause: dict[tuple[str, str], list[float]] = {}
    end = None
    for e in sorted(gpu, key=lambda e: e["ts"]):
        if end is not None and e["ts"] - end >= min_gap_us:
            at = queued.get(e.get("args", {}).get("correlation"), e["ts"])
            a, b = next(((a, b) for a, b in steps if a <= at < b), (at, at + 1))
            cause = by_cause.setdefault(("host-bound" if at >= end else "queued earlier", _chain(chains, e)),
                                        [0.0, 0, 0.0])
            cause[0] += e["ts"] - end
            cause[1] += 1
            cause[2] += (at - a) / (b - a)
        end = max(end if end is not None else e["ts"], e["ts"] + e["dur"])
    if not by_cause:
        return
    print(f"  idle, by the host op chain that queued the work after each gap of {min_gap_us:g} us or more:")
    for (kind, chain), (us, count, where) in sorted(by_cause.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"      {us / n / 1e3:8.2f} ms  {count / n:6.1f} gaps per step  {kind:<14}  at {where / count:4.0%} of "
              f"its step  {chain[:250]}")


# ------------------------------------------------------------------------------------------------
# children: one run each, printing one RESULT line
# ------------------------------------------------------------------------------------------------
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _profile_peer(run, steps: int, trace: Path) -> dict:
    """Trace `steps` steps of the peer between a lead step and a closing one (see breakdown)."""
    import torch
    from torch.profiler import ProfilerActivity

    from titan_te.profiling import step_profiler, traced_steps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with step_profiler(activities, traced_steps(skip_first=1, active=steps + 1),
                       lambda p: p.export_chrome_trace(str(trace))) as prof:
        run(steps + 2, each=prof.step)  # its last step reads the loss: the counted steps' GPU work has ended
    return breakdown(trace)


def _timed(fn, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds per step, seconds of a call of fn that runs no step): the second is taken out of the first."""
    def wall(n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        fn(n)
        _sync()
        return time.perf_counter() - t0

    fn(warmup)
    fixed = wall(0)
    return (wall(steps) - fixed) / steps, fixed


def child_preset(a, overrides: list[str]) -> dict:
    from titan_te import config as config_mod
    from titan_te.logging_setup import setup_logging
    from titan_te.metrics import causal_flops_per_token
    from titan_te.trainer import Trainer

    preset, _, _ = PRESETS[a.size]
    # the traced steps lie inside one training loop, after a lead step and before a closing one (see breakdown)
    first = a.warmup + a.steps + 2
    total = first + a.profile_steps
    traces = Path(a.tmp) / "traces"
    argv = ["--config", preset, f"--training.steps={total}", "--checkpoint.enable=false",
            "--metrics.enable_tensorboard=false", f"--job.dump_folder={a.tmp}", "--profiling.enable_profiling=true",
            f"--profiling.profile_start={first}", f"--profiling.profile_active={a.profile_steps + 1}",
            f"--profiling.traces_folder={traces}", *a.overrides, *overrides]
    argv += [f"--training.seq_len={a.seq_len}"] + ([f"--model.n_layers={a.n_layers}"] if a.n_layers else [])
    argv += [f"--model.flavor={a.flavor}"] if a.flavor else []
    cfg, _ = config_mod.load(argv)
    setup_logging()
    with Trainer(cfg) as tr:
        done = [0]

        def run(n: int) -> None:
            done[0] += n
            tr.train(until_step=done[0])

        step_s, call_s = _timed(run, a.warmup, a.steps)
        peak = _peak_gib()
        run(a.profile_steps + 2)
        try:
            parts = breakdown(traces / f"step-{first}" / f"rank{tr.env.rank}.json")
        except (NoBreakdown, FileNotFoundError) as e:  # older code (a *_before run) may trace other steps or
            # write its traces elsewhere: its speed still counts
            print(f"no breakdown: {e}", flush=True)
            parts = {}
        tokens, flops = tr.tokens_per_step, tr.model_args.flops_per_token(cfg.training.seq_len)
        causal = causal_flops_per_token(tr.model_args, cfg.training.seq_len)
        losses = [tr.losses[0], tr.losses[-1]]
    return {"step_s": step_s, "call_s": call_s, "tokens": tokens, "flops_per_token": flops,
            "causal_flops_per_token": causal, "peak_gib": peak, "parts": parts, "losses": losses}


def child_peer(a, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_llama import build_peer, peer_step

    from titan_te.metrics import causal_flops_per_token
    from titan_te.models.llama import FLAVORS, resolve_args

    _, flavor, batch = PRESETS[a.size]
    batch, accum = opts.get("batch", batch), opts.get("accum", 1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    args = resolve_args(FLAVORS[a.flavor or flavor], VOCAB, a.seq_len, a.n_layers)
    model, opt = build_peer(args, opts["float8"], opts["bf16_state"], device)
    g = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, args.vocab_size, (batch, a.seq_len + 1), device=device, generator=g)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    losses: list[float] = []
    done = [0]

    def run(n: int, each=None) -> None:
        for i in range(n):
            loss = peer_step(model, opt, tokens, labels, accum)
            done[0] += 1
            if done[0] % 10 == 0 or i == n - 1:  # log steps only: torchtitan reads the loss there
                losses.append(loss.item())
            if each is not None:
                each()

    step_s, call_s = _timed(run, a.warmup, a.steps)
    peak = _peak_gib()
    parts = _profile_peer(run, a.profile_steps, Path(a.tmp) / "trace.json")
    dist.destroy_process_group()
    return {"step_s": step_s, "call_s": call_s, "tokens": accum * batch * a.seq_len,
            "flops_per_token": args.flops_per_token(a.seq_len),
            "causal_flops_per_token": causal_flops_per_token(args, a.seq_len), "peak_gib": peak, "parts": parts,
            "losses": [losses[0], losses[-1]]}


def child(a) -> int:
    kind, size, extra = RUNS[a.child]
    a.size = size
    with tempfile.TemporaryDirectory(dir=a.scratch or None) as tmp:
        a.tmp = tmp
        if kind == "blocks_plan":  # this process only: llama3's wrap plan swapped for the blocks-only one
            from titan_te.models import MODELS, blocks

            MODELS.get("llama3").fsdp_units = blocks
        result = child_peer(a, extra) if kind == "peer" else child_preset(a, extra)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"name": a.child, "gpus": int(os.environ.get("WORLD_SIZE", "1")), **result}),
              flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# parent: one process per run, then the tables
# ------------------------------------------------------------------------------------------------
def _rank_env(env: dict, rank: int, world: int, port: int) -> dict:
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(name: str, a, gpus: int = 1) -> dict | None:
    """One run in fresh processes: `gpus` ranks (NCCL, one GPU each) for the presets, one for the peer."""
    kind = RUNS[name][0]
    root = Path(a.before).resolve() if kind == "before" else ROOT
    from titan_te.main import set_environment_defaults  # this checkout's (main() put it on the path); no torch

    env = dict(os.environ)
    set_environment_defaults(env)  # every run, the peer's too, starts as train.py does (torchtitan's allocator)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and Path(p).resolve() != ROOT])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, f"--warmup={a.warmup}",
           f"--steps={a.steps}", f"--profile_steps={a.profile_steps}", f"--n_layers={a.n_layers}",
           f"--scratch={a.scratch}", f"--seq_len={a.seq_len}", f"--flavor={a.flavor}", *[f"--override={o}" for o in a.overrides]]
    log = Path(a.log_dir) / f"{name}{f'-{gpus}gpu' if gpus > 1 else ''}.log"
    t0 = time.perf_counter()
    port = _free_port()
    with open(log, "w") as f:
        procs = [subprocess.Popen(cmd, cwd=root, env=_rank_env(env, r, gpus, port) if gpus > 1 else env,
                                  stdout=f if r == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for r in range(gpus)]
        try:
            codes = [p.wait(timeout=a.timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            print(f"{name}: timed out after {a.timeout} s (log {log})", flush=True)
            return None
    r = subprocess.CompletedProcess(cmd, max(codes, key=abs))
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = log.read_text().strip().splitlines()[-3:]
        print(f"{name}: failed with exit code {r.returncode} (log {log}): {' | '.join(tail)}", flush=True)
        return None
    top = [ln for ln in log.read_text().splitlines() if " ms  " in ln][:20]
    print(f"{name}: the kernels taking most time per step\n" + "\n".join(top), flush=True)
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t0
    res["tok_s"] = res["tokens"] / res["step_s"] / res.get("gpus", 1)  # per GPU
    res["tflops"] = res["tok_s"] * res["flops_per_token"] / 1e12
    res["tflops_causal"] = res["tok_s"] * res["causal_flops_per_token"] / 1e12
    print(f"{name}: {res['tok_s']:,.0f} tok/s, {res['tflops']:.0f} TFLOP/s, peak {res['peak_gib']:.1f} GiB, "
          f"loss {res['losses'][0]:.3f} -> {res['losses'][1]:.3f}, {1e3 * res['call_s']:.0f} ms per call "
          f"({res['wall_s']:.0f} s)", flush=True)
    return res


def _peer_of(name: str, results: dict[str, dict]) -> dict | None:
    """The peer run of `name`'s size with as many tokens per optimizer step, else the size's plain peer."""
    size = RUNS[name][1]
    same = [r for n, r in results.items()
            if RUNS[n][0] == "peer" and RUNS[n][1] == size and r["tokens"] == results[name]["tokens"]]
    return same[0] if same else results.get(f"{size}_peer")


def tables(results: dict[str, dict]) -> str:
    rows = ["| run | tok/s | TFLOP/s | TFLOP/s, Megatron's count | MFU | peak GiB | vs peer |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        peer = _peer_of(name, results)
        ratio = f"{r['tok_s'] / peer['tok_s']:.3f}x" if peer else "n/a"
        rows.append(f"| {name} | {r['tok_s']:,.0f} | {r['tflops']:.0f} | {r['tflops_causal']:.0f} | "
                    f"{100 * r['tflops'] * 1e12 / PEAK:.1f}% | "
                    f"{r['peak_gib']:.1f} | {ratio} |")
    rows += ["", "ms per step: step ms timed, traced ms of the traced steps (the profiler slows them), split by kernel "
             "category (idle: no kernel running)", "",
             "| run | step ms | traced ms | " + " | ".join(COLUMNS) + " | GPU busy |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " | ---: |"]
    for name, r in results.items():
        p = r["parts"]
        if not p:
            rows.append(f"| {name} | {1e3 * r['step_s']:.1f} |" + " n/a |" * (len(COLUMNS) + 2))
            continue
        rows.append(f"| {name} | {1e3 * r['step_s']:.1f} | {p['traced_ms']:.1f} | "
                    + " | ".join(f"{p[c]:.1f}" for c in COLUMNS)
                    + f" | {p['busy_pct']:.1f}% |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of: {', '.join(RUNS)}")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile_steps", type=int, default=2)
    ap.add_argument("--n_layers", type=int, default=0, help="override the number of blocks (0: the flavor's)")
    ap.add_argument("--seq_len", type=int, default=SEQ)
    ap.add_argument("--flavor", default="", help="override the model flavor of every run (default: 1B / 8B)")
    ap.add_argument("--override", dest="overrides", action="append", default=[],
                    help="an extra --section.key=value for every preset run (repeatable)")
    ap.add_argument("--before", default="", help="a checkout of older code for the *_before runs")
    ap.add_argument("--log_dir", default="", help="where each run's log goes (default: a temporary folder)")
    ap.add_argument("--scratch", default="", help="folder for run folders and traces (default: the temp dir)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--out", default="", help="also write the tables to this file")
    ap.add_argument("--json", default="", help="also write every run's figures (the planner's --breakdown)")
    ap.add_argument("--ngpu", type=int, default=1, help="also run the presets on this many GPUs (NCCL) and print "
                                                        "tokens/s per GPU and the scaling efficiency against 1 GPU")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.warmup < 1 or a.steps < 1:
        print("train_bench: --warmup and --steps must be at least 1", file=sys.stderr)
        return 2
    if a.child:
        return child(a)
    sys.path.insert(0, str(ROOT))  # the parent only: a *_before child imports the older checkout's titan_te
    unknown = [n for n in a.runs.split(",") if n not in RUNS]
    if unknown:
        print(f"train_bench: unknown run(s) {', '.join(unknown)}; known: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    if any(RUNS[n][0] == "before" for n in a.runs.split(",")) and not Path(a.before, "titan_te").is_dir():
        print("train_bench: the *_before runs need --before pointing at a checkout holding titan_te/",
              file=sys.stderr)
        return 2
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="train_bench_")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.runs.split(","):
        res = run_child(name, a)
        if res is not None:
            results[name] = res
    text = tables(results)
    if a.ngpu > 1:  # the presets again on N GPUs (the peer stays a one-GPU reference)
        scaled = {n: run_child(n, a, a.ngpu) for n in results if RUNS[n][0] != "peer"}
        text += "\n\n" + scaling_table(results, scaled, a.ngpu)
        results.update({f"{n}@{a.ngpu}gpu": r for n, r in scaled.items() if r is not None})
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if len(results) >= len(a.runs.split(",")) else 1


def scaling_table(one: dict, many: dict, gpus: int) -> str:
    rows = [f"tokens/s per GPU on 1 and {gpus} GPUs (NCCL; each GPU at the preset's batch)", "",
            f"| run | 1 GPU | {gpus} GPUs | scaling efficiency |", "| --- | ---: | ---: | ---: |"]
    for name, r in many.items():
        got = f"{r['tok_s']:,.0f} | {r['tok_s'] / one[name]['tok_s']:.1%}" if r else "failed | n/a"
        rows.append(f"| {name} | {one[name]['tok_s']:,.0f} | {got} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
