"""`fused_adam`: AdamW over local shards, for FP32, BF16/FP16 and TE FP8 (QuantizedTensor) weights.

Every parameter, gradient and state is unwrapped from its DTensor once; the local tensors are
grouped into buckets (param group x parameter kind) and each bucket is updated by one multi-tensor
kernel per step: TE's `multi_tensor_adam` family on CUDA when TE is importable, torch `_foreach_`
math otherwise. States are kept as DTensors that share storage with the local tensors, so
`torch.distributed.checkpoint` saves and reshards them.

Kinds (the `kind` of a bucket):
  fp32          FP32 weights, updated in place (no master copy: it would only go stale)
  lowp          BF16/FP16 weights, no master: updated in their own dtype
  lowp_master   BF16/FP16 weights with FP32 masters: the master is updated, the weight rounded from it
  lowp_remain   BF16 weights + int16 remainders of the FP32 master (store_param_remainders, TE kernel)
  quantized     TE FP8 weights with FP32 masters: the master is updated and the FP8 weight written from
                it, in one kernel where there is one (TE's for FP32 moments, ours in Triton for others,
                delayed scaling), else the weight is re-quantized from the master after the update
"""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from titan_te.errors import ConfigError
from titan_te.init_weights import local_tensor
from titan_te.optim import LEAN_ADAM, OPTIMIZERS, OptimizerSpec
from titan_te import triton_support
from titan_te.optim import triton_adam
from titan_te.optim.param_groups import decay_groups
from titan_te.te import kernels, tensors

logger = logging.getLogger("titan_te")
TE_CHUNK = 2048 * 32  # elements per block of TE's multi-tensor kernels
TE_MAX_TENSORS = 1024  # tensors per kernel call
CPU_SLICE = 1 << 24  # elements per torch _foreach_ slice (bounds FP32 temporaries)


class FusedAdamError(ConfigError):
    """A parameter/option combination this optimizer will not run silently wrong."""


def _te_kernels():
    """TE's multi-tensor Adam kernels, or None without TE / CUDA (torch's foreach math then)."""
    return kernels.adam_kernels("optimizer.name = 'fused_adam'")


@dataclass
class Bucket:
    group: dict
    kind: str
    params: list  # the nn.Parameters (DTensor or plain)
    weights: list = field(default_factory=list)  # local tensors written each step (plain, or QuantizedTensor)
    masters: list = field(default_factory=list)  # local FP32 masters (or int16 remainders)
    exp_avg: list = field(default_factory=list)
    exp_avg_sq: list = field(default_factory=list)
    writer: str | None = None  # quantized: the kernel that also writes the FP8 weights (FusedAdam._fp8_writer)


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 master_weights: bool = True, moment_dtype: torch.dtype = torch.float32,
                 store_param_remainders: bool = False, use_te_kernels: bool | None = None, streams: int = 2,
                 triton: bool = True, init_value=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, step=0)
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.moment_dtype = moment_dtype
        self.store_param_remainders = store_param_remainders
        te_kernels = _te_kernels()
        if use_te_kernels and te_kernels is None:
            raise FusedAdamError("fused_adam: TE kernels requested but Transformer Engine or CUDA is missing")
        self._te = te_kernels if use_te_kernels is not False else None
        self._triton = triton and self._te is not None and triton_support.available()
        self._buckets: list[Bucket] | None = None
        # init_value(local FP8 weight) -> its value before quantization, or None (fp8.preserve_high_precision_init)
        self._init_value = init_value
        self.grad_scale: torch.Tensor | None = None  # set by the trainer: the clip coefficient for this step
        self._noop = None
        # streams > 1: TE kernel launches are spread over that many CUDA streams (each launch holds a
        # bounded number of blocks, so concurrent streams fill the GPU better: README, optimizers)
        self._streams = streams if self._te is not None else 1
        self._side: list | None = None
        for group in self.param_groups:
            for p in group["params"]:
                self._kind(p)  # refuse unsupported combinations now, not at the first step

    # --- classification ------------------------------------------------------------------------
    def _kind(self, p) -> str:
        local = local_tensor(p)
        if tensors.is_quantized(local):
            if not self.master_weights:
                raise FusedAdamError(
                    "fused_adam: FP8 weights need optimizer.master_weights = true (an FP8 weight cannot hold "
                    "an Adam update; TE's FusedAdam silently never updates delayed-scaling FP8 weights "
                    "without masters)")
            return "quantized"
        if local.dtype == torch.float32:
            return "fp32"
        if local.dtype in (torch.bfloat16, torch.float16):
            if self.store_param_remainders and self.master_weights:
                if local.dtype != torch.bfloat16:
                    raise FusedAdamError("fused_adam: store_param_remainders works with BF16 weights only")
                if self._te is None:
                    raise FusedAdamError("fused_adam: store_param_remainders needs CUDA and Transformer "
                                         "Engine's multi_tensor_adam_param_remainder kernel")
                return "lowp_remain"
            return "lowp_master" if self.master_weights else "lowp"
        raise FusedAdamError(f"fused_adam: parameters of dtype {local.dtype} are not supported")

    # --- state -----------------------------------------------------------------------------------
    @staticmethod
    def _wrap_like(p, local: torch.Tensor):
        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return local

    @torch.no_grad()
    def _init_state(self, p) -> None:
        kind = self._kind(p)
        local = local_tensor(p)
        high = local.dequantize() if kind == "quantized" else local
        hp = self._init_value(local) if kind == "quantized" and self._init_value is not None else None
        if hp is not None:  # fp8.preserve_high_precision_init
            high = hp.to(local.device)
        state = self.state[p]
        shape = local.shape
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = self._wrap_like(p, torch.zeros(shape, dtype=self.moment_dtype, device=local.device))
        if kind in ("lowp_master", "quantized"):
            state["master_param"] = self._wrap_like(p, high.detach().float().clone().reshape(shape))
        elif kind == "lowp_remain":
            state["master_param"] = self._wrap_like(p, torch.zeros(shape, dtype=torch.int16, device=local.device))

    def _build_buckets(self) -> list[Bucket]:
        buckets: dict[tuple[int, str], Bucket] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self._init_state(p)
                kind = self._kind(p)
                b = buckets.setdefault((gi, kind), Bucket(group, kind, []))
                s = self.state[p]
                b.params.append(p)
                b.weights.append(local_tensor(p))
                b.exp_avg.append(local_tensor(s["exp_avg"]))
                b.exp_avg_sq.append(local_tensor(s["exp_avg_sq"]))
                if "master_param" in s:
                    b.masters.append(local_tensor(s["master_param"]))
        for b in buckets.values():
            b.writer = self._writer(b)
        return list(buckets.values())

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self._buckets = None

    def load_state_dict(self, state_dict) -> None:
        """Copy saved states into ours, keeping the configured dtypes (FP32 masters, moment_dtype)."""
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self._init_state(p)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("fused_adam: the saved optimizer has a different number of parameter groups")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("fused_adam: a saved parameter group has a different number of parameters")
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            for pid, p in zip(saved["params"], group["params"]):
                for name, value in state_dict["state"].get(pid, {}).items():
                    if name not in self.state[p]:
                        continue
                    dst = local_tensor(self.state[p][name])
                    src = local_tensor(value) if torch.is_tensor(value) else torch.as_tensor(value)
                    if src.data_ptr() != dst.data_ptr():
                        with torch.no_grad():
                            dst.copy_(src.reshape(dst.shape))
        self._buckets = None

    # --- the step --------------------------------------------------------------------------------
    def scale_grads_in_step(self, scale: torch.Tensor) -> None:
        """Multiply the gradients by `scale` (a device scalar, e.g. the clip coefficient) in the next
        step: inside the Triton kernel for FP32 and FP8 weights, as one foreach pass before the update
        otherwise."""
        self.grad_scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        scale, self.grad_scale = self.grad_scale, None
        if self._buckets is None:
            self._buckets = self._build_buckets()
        for group in self.param_groups:
            group["step"] += 1
        for b in self._buckets:
            grads, keep = [], []
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    grads.append(local_tensor(p.grad))
                    keep.append(i)
            if not grads:
                continue
            sel = (lambda xs: xs) if len(keep) == len(b.params) else (lambda xs: [xs[i] for i in keep])
            self._update(b, grads, sel, scale)
        return loss

    def _update(self, b: Bucket, grads, sel, scale=None) -> None:
        g = b.group
        hp = (float(g["lr"]), *g["betas"], g["eps"], g["weight_decay"], g["step"])
        weights, m, v = sel(b.weights), sel(b.exp_avg), sel(b.exp_avg_sq)
        masters = sel(b.masters) if b.masters else []
        writer = b.writer
        if writer != "triton" and b.kind in ("fp32", "quantized") and any(t.dtype != torch.float32 for t in grads):
            # bf16 gradients of FP32 weights (model.wgrad_dtype): the Triton kernels convert as they load; the
            # TE and torch paths get FP32 copies
            grads = [t if t.dtype == torch.float32 else t.float() for t in grads]
        if scale is not None and writer != "triton":
            torch._foreach_mul_(grads, scale)
        if writer == "triton" and b.kind == "quantized":
            triton_adam.adam_fp8_(grads, weights, masters, m, v, *hp, grad_scale=scale)
        elif writer == "triton":
            triton_adam.adam_(grads, weights, m, v, *hp, grad_scale=scale)
        elif self._te is not None:  # TE's kernels read and write bf16 moments directly
            self._te_update(b.kind, writer, grads, weights, masters, m, v, *hp)
        else:
            self._torch_update(b.kind, grads, weights, masters, m, v, *hp)
        if b.kind == "quantized" and writer is None:
            for w, master in zip(weights, masters):
                w.quantize_(master)

    def _writer(self, b: Bucket) -> str | None:
        """The kernel that updates a bucket in one pass where it is not TE's multi-tensor Adam: "triton" for
        FP32 weights (ours reads and writes each byte once and applies the clip factor), the FP8 writer for
        FP8 weights, None: the TE or torch path of the bucket's kind."""
        if b.kind == "quantized":
            return self._fp8_writer(b.weights)
        return "triton" if b.kind == "fp32" and self._triton else None

    def _fp8_writer(self, weights) -> str | None:
        """Which kernel updates the masters of delayed-scaling Float8Tensor weights and writes their FP8
        bytes in the same pass: "te" (TE's multi_tensor_adam_fp8, FP32 moments only), "triton" (ours, any
        moments), or None: the master is updated, then each weight re-quantized."""
        if self._te is None:
            return None
        if not all(tensors.delayed_fp8(w) is not None for w in weights):
            return None
        if self.moment_dtype == torch.float32:
            return "te"
        return "triton" if self._triton else None

    def _te_update(self, kind, writer, grads, weights, masters, m, v, lr, beta1, beta2, eps, wd, step) -> None:
        tex = self._te
        if self._noop is None:
            self._noop = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        extra = ()
        if kind in ("fp32", "lowp"):
            lists, fn = [grads, weights, m, v], tex.multi_tensor_adam
        elif kind == "lowp_master":
            lists, fn = [grads, weights, m, v, masters], tex.multi_tensor_adam
        elif kind == "lowp_remain":
            lists, fn = [grads, weights, m, v, masters], tex.multi_tensor_adam_param_remainder
        elif writer == "te":  # delayed scaling, FP32 moments: master update + FP8 write
            fp8 = [tensors.delayed_fp8(w) for w in weights]
            lists = [grads, [x.raw for x in fp8], m, v, masters, [x.scale for x in fp8], [x.amax for x in fp8],
                     [x.scale_inv for x in fp8]]
            fn, extra = tex.multi_tensor_adam_fp8, (fp8[0].te_dtype,)
        else:  # other quantized weights: the FP32 master is the kernel's parameter; re-quantized after
            grads = [t if t.dtype == torch.float32 else t.float() for t in grads]
            lists, fn = [grads, masters, m, v], tex.multi_tensor_adam
        if any(t.numel() == 0 for t in grads):  # an FSDP2 shard can be empty on some ranks
            keep = [i for i, t in enumerate(grads) if t.numel()]
            lists = [[lst[i] for i in keep] for lst in lists]
        for sub, stream in self._spread(lists):
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                for start in range(0, len(sub[0]), TE_MAX_TENSORS):
                    fn(TE_CHUNK, self._noop, [lst[start:start + TE_MAX_TENSORS] for lst in sub], lr, beta1, beta2,
                       eps, step, 1, 1, wd, *extra)  # mode 1 = AdamW (decoupled decay), bias correction on
        self._join_streams()
        if extra:
            for w in weights:
                tensors.written_in_place(w)

    def _spread(self, lists):
        """(tensor lists, stream or None) parts of about equal element counts, one per stream; the
        side streams first wait for the work queued so far on the current stream."""
        if self._streams == 1:
            return [(lists, None)]
        if self._side is None:
            self._side = [torch.cuda.Stream() for _ in range(self._streams - 1)]
        current = torch.cuda.current_stream()
        sizes = [t.numel() for t in lists[0]]
        per, parts, acc, start = sum(sizes) / self._streams, [], 0, 0
        for i, n in enumerate(sizes):
            acc += n
            if acc >= per * (len(parts) + 1) and len(parts) < self._streams - 1:
                parts.append((start, i + 1))
                start = i + 1
        parts.append((start, len(sizes)))
        out = []
        for k, (a, b) in enumerate(parts):
            if a == b:
                continue
            stream = None if k == 0 else self._side[k - 1]
            if stream is not None:
                stream.wait_stream(current)
            out.append(([lst[a:b] for lst in lists], stream))
        return out

    def _join_streams(self) -> None:
        if self._side is not None:
            current = torch.cuda.current_stream()
            for stream in self._side:
                current.wait_stream(stream)

    @staticmethod
    def _torch_update(kind, grads, weights, masters, m, v, lr, beta1, beta2, eps, wd, step) -> None:
        """torch _foreach_ math in FP32, in slices of about CPU_SLICE elements so FP32 copies of bf16
        moments or weights never cost more than one slice of extra memory."""
        start, n = 0, len(grads)
        while start < n:
            end, size = start, 0
            while end < n and (end == start or size + grads[end].numel() <= CPU_SLICE):
                size += grads[end].numel()
                end += 1
            sl = slice(start, end)
            FusedAdam._torch_slice(kind, grads[sl], weights[sl], masters[sl] if masters else [], m[sl], v[sl],
                                   lr, beta1, beta2, eps, wd, step)
            start = end

    @staticmethod
    def _torch_slice(kind, grads, weights, masters, m_store, v_store, lr, beta1, beta2, eps, wd, step) -> None:
        f32 = (lambda ts: ts if not ts or ts[0].dtype == torch.float32 else [t.float() for t in ts])
        if kind == "fp32":
            targets = weights
        elif kind == "lowp":
            targets = [w.float() for w in weights]
        else:  # lowp_master, quantized
            targets = masters
        grads, m, v = f32(grads), f32(m_store), f32(v_store)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        if wd:
            torch._foreach_mul_(targets, 1 - lr * wd)
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(targets, m, denom, -lr / bc1)
        if m is not m_store:  # bf16 moments: store the FP32 result rounded
            torch._foreach_copy_(m_store, m)
            torch._foreach_copy_(v_store, v)
        if kind in ("lowp", "lowp_master"):
            torch._foreach_copy_(weights, targets)


def build_fused_adam(named_params, ocfg, device_type: str, init_value=None) -> FusedAdam:
    return FusedAdam(decay_groups(named_params, ocfg.weight_decay), lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2),
                     eps=ocfg.eps, master_weights=ocfg.master_weights,
                     moment_dtype=getattr(torch, ocfg.moment_dtype),
                     store_param_remainders=ocfg.store_param_remainders,
                     use_te_kernels=None if device_type == "cuda" else False, triton=ocfg.triton,
                     init_value=init_value)


OPTIMIZERS.register("fused_adam")(OptimizerSpec(name="fused_adam", build=build_fused_adam,
                                                  takes_high_precision_init=True, reads_low_precision_grads=True,
                                                  reads=LEAN_ADAM + ("triton",)))
