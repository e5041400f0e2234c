"""Optimizer step time for the Llama-3 1B flavor's parameters (run on a CUDA GPU).

    python benchmarks/optim_bench.py [--flavor 1B] [--ranks 1,8,64] [--kinds fp32,fp8]

For each size -- the full model (1 rank) and the shard one rank holds at 8 and 64 ranks -- every
parameter is a DTensor on a one-rank mesh whose local tensor has the shard's shape, as FSDP2 hands
them to an optimizer. Each optimizer then takes timed steps (CUDA events, median of --iters after
--warmup). The HBM byte floor is the bytes the update must read and write divided by --hbm_tbs:

  fp32   FP32 weights, FP32 moments:            read w,g,m,v (16 B) + write w,m,v (12 B) = 28 B/elem
  fp8    FP8 block weights (delayed scaling) with FP32 masters and FP32 moments: read g, master, m, v
         (16 B) + write master, m, v (12 B) + the FP8 weight (1 B) = 29 B/elem; FP32 embeddings 28 B/elem
  fp8bm  the same with bf16 moments (the llama_fp8 preset): 21 B/elem, FP32 embeddings 20 B/elem

Optimizers: adamw (torch, fused=True; fp32 only), te_fused_adam (TE's FusedAdam), fused_adam (ours: with bf16
moments its FP8 weights take one Triton kernel), fused_adam_2pass (ours without Triton: TE's kernel on the masters,
then a re-quantization pass).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from cuda_timing import median_ms  # noqa: E402
from titan_te.models.llama import FLAVORS  # noqa: E402


def floor_bytes(params, kind: str) -> int:
    saved = 8 if kind == "fp8bm" else 0  # bf16 moments: 2 x (read + write) x 2 bytes less
    return sum((29 if type(p.to_local()).__name__ == "Float8Tensor" else 28) * p.to_local().numel() - saved *
               p.to_local().numel() for p in params)


def shapes(flavor: str) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is_block_linear) of every parameter of the flavor."""
    a = FLAVORS[flavor]
    hd = a.dim // a.n_heads
    block = [((a.dim,), False), (((a.n_heads + 2 * a.n_kv_heads) * hd, a.dim), True),
             ((a.dim, a.n_heads * hd), True), ((a.dim,), False), ((2 * a.ffn_dim, a.dim), True),
             ((a.dim, a.ffn_dim), True)]
    return [((a.vocab_size, a.dim), False)] + block * a.n_layers + [((a.dim,), False), ((a.vocab_size, a.dim), False)]


def make_params(flavor: str, ranks: int, kind: str, mesh) -> list[torch.nn.Parameter]:
    params = []
    for shape, linear in shapes(flavor):
        local_shape = (-(-shape[0] // ranks),) + shape[1:]
        local = torch.randn(local_shape, device="cuda") * 0.02
        if kind.startswith("fp8") and linear:
            import transformer_engine_torch as tex
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

            q = Float8Quantizer(scale=torch.ones(1, device="cuda"), amax=torch.zeros(1, device="cuda"),
                                fp8_dtype=tex.DType.kFloat8E4M3)  # a delayed-scaling weight quantizer
            local = q(local)
        p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        p.grad = DTensor.from_local(torch.randn(local_shape, device="cuda") * 1e-3, mesh, [Shard(0)],
                                    run_check=False)
        params.append(p)
    return params


def build(name: str, params, kind: str, streams: int = 1):
    moments = torch.bfloat16 if kind == "fp8bm" else torch.float32
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "te_fused_adam":
        from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

        return TEFusedAdam(params, lr=1e-4, master_weights=kind != "fp32", master_weight_dtype=torch.float32,
                           exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    from titan_te.optim.fused_adam import FusedAdam

    return FusedAdam(params, lr=1e-4, master_weights=True, moment_dtype=moments, streams=streams,
                     triton=name != "fused_adam_2pass")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--ranks", default="1,8,64")
    ap.add_argument("--kinds", default="fp32,fp8,fp8bm")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--optimizers", default="", help="comma-separated subset of adamw,te_fused_adam,fused_adam,"
                                                         "fused_adam_2pass")
    ap.add_argument("--streams", type=int, default=2, help="fused_adam: CUDA streams for its kernel launches")
    ap.add_argument("--chunk", type=int, default=0, help="fused_adam: elements per block of TE's kernels "
                                                        "(default: fused_adam.TE_CHUNK)")
    ap.add_argument("--hbm_tbs", type=float, default=4.3, help="HBM bandwidth in TB/s (H200: 4.8 peak, 4.3 usable)")
    ap.add_argument("--triton_block", type=int, default=0, help="fused_adam: elements per program of its Triton "
                                                                "kernel (default: triton_adam.BLOCK)")
    ap.add_argument("--triton_warps", type=int, default=0, help="fused_adam: warps per program of its Triton kernel "
                                                                "(default: triton_adam.WARPS)")
    a = ap.parse_args()
    if a.chunk:
        from titan_te.optim import fused_adam

        fused_adam.TE_CHUNK = a.chunk
    from titan_te.optim import triton_adam

    triton_adam.BLOCK = a.triton_block or triton_adam.BLOCK
    triton_adam.WARPS = a.triton_warps or triton_adam.WARPS
    if not torch.cuda.is_available():
        print("optim_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    print(f"fused_adam's Triton kernel: {triton_adam.BLOCK} elements and {triton_adam.WARPS} warps per program")
    print(f"{'kind':<5} {'ranks':>5} {'M elems':>9} {'optimizer':<14} {'ms':>8} {'floor ms':>9} {'x floor':>8}")
    for kind in a.kinds.split(","):
        names = ["adamw", "te_fused_adam", "fused_adam"] if kind == "fp32" else ["te_fused_adam", "fused_adam", "fused_adam_2pass"]
        names = [n for n in names if not a.optimizers or n in a.optimizers.split(",")]
        for ranks in [int(r) for r in a.ranks.split(",")]:
            for name in names:
                params = make_params(a.flavor, ranks, kind, mesh)
                n = sum(p.to_local().numel() for p in params)
                floor = floor_bytes(params, kind) / (a.hbm_tbs * 1e12) * 1e3
                try:
                    opt = build(name, params, kind, a.streams)
                    ms = median_ms(opt.step, a.iters, warmup=a.warmup)
                except RuntimeError as e:  # report, and go on with the other optimizers
                    print(f"{kind:<5} {ranks:>5} {n / 1e6:>9.1f} {name:<14} fails: {str(e).splitlines()[0][-110:]}")
                    opt = None
                    continue
                print(f"{kind:<5} {ranks:>5} {n / 1e6:>9.1f} {name:<14} {ms:>8.3f} {floor:>9.3f} {ms / floor:>8.2f}",
                      flush=True)
                del opt, params
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
