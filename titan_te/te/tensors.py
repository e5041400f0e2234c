"""FP8 tensors from the outside: the one place that reads TE tensors' private fields.

Optimizers write FP8 weights in place, the fused output head quantizes its operands, init writes values into
FP8 weights: each asks a function here instead of reaching into `_data`, `_scale_inv`, `_quantizer` or
`_reset_caches`, so a TE upgrade that renames them changes this file only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def is_quantized(t) -> bool:
    """A TE quantized tensor (an FP8 weight of any recipe); False without TE."""
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor
    except ImportError:
        return False
    return isinstance(t, QuantizedTensor)


def write(target: torch.Tensor, value: torch.Tensor) -> None:
    """Store `value` in a parameter: FP8 weights quantize it (with their own recipe), others copy it."""
    if is_quantized(target):
        target.quantize_(value.to(torch.float32))
    else:
        target.copy_(value)


@dataclass
class DelayedFP8:
    """The parts of a delayed-scaling FP8 tensor that a kernel writes in place: the FP8 bytes (raw uint8 and as
    the torch float8 dtype), the scale the next write uses, the amax it records there, the inverse scale
    readers multiply by, TE's dtype code, and the column-wise (transposed) bytes where the tensor has them."""

    raw: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    scale_inv: torch.Tensor
    te_dtype: object
    transpose: torch.Tensor | None = None

    @property
    def fp8_max(self) -> float:
        """The largest finite value of the FP8 dtype (casts saturate to it)."""
        return torch.finfo(self.data.dtype).max


def delayed_fp8(w) -> DelayedFP8 | None:
    """The in-place-writable parts of a delayed-scaling FP8 weight, or None for any other tensor."""
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
    except ImportError:
        return None
    if not (isinstance(w, Float8Tensor) and isinstance(w._quantizer, Float8Quantizer)):
        return None
    q = w._quantizer
    return DelayedFP8(w._data, w._data.view(_torch_fp8(w._fp8_dtype)), q.scale, q.amax, w._scale_inv, w._fp8_dtype)


def _torch_fp8(te_dtype) -> torch.dtype:
    """torch's float8 dtype for TE's FP8 dtype code."""
    import transformer_engine_torch as tex

    return torch.float8_e5m2 if te_dtype == tex.DType.kFloat8E5M2 else torch.float8_e4m3fn


def is_delayed_quantizer(q) -> bool:
    """A delayed-scaling quantizer (TE's Float8Quantizer: its scale is set before the data is seen)."""
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    except ImportError:
        return False
    return type(q) is Float8Quantizer


def wants_rowwise(q) -> bool:
    """Whether a quantizer's tensors are made with their row-wise layout."""
    return q.rowwise_usage


def new_delayed(quantizer, shape, dtype: torch.dtype, device) -> tuple[object, DelayedFP8]:
    """An uninitialized tensor of delayed-scaling `quantizer` (its layouts as the quantizer's usage says; a TE
    tensor that stands for `dtype`) and the parts a kernel writes to fill it."""
    t = quantizer.make_empty(list(shape), dtype=dtype, device=device)
    fp8 = _torch_fp8(quantizer.dtype)
    transpose = t._transpose.view(fp8) if t._transpose is not None else None
    return t, DelayedFP8(t._data, t._data.view(fp8), quantizer.scale, quantizer.amax, t._scale_inv, quantizer.dtype,
                         transpose)


def fp8_bytes(t) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A per-tensor-scaled FP8 tensor's row-wise bytes and its column-wise (transposed) ones or None, as uint8."""
    return t._data.view(torch.uint8), t._transpose.view(torch.uint8) if t._transpose is not None else None


def is_float8(w) -> bool:
    """A per-tensor-scaled FP8 weight (delayed or current scaling): the kind TE's FusedAdam writes in place."""
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    except ImportError:
        return False
    return isinstance(w, Float8Tensor)


def written_in_place(w) -> None:
    """After a kernel wrote an FP8 weight's row-wise bytes: the transpose TE derived from the old ones is stale.
    Where TE derives it only when a GEMM needs it (transpose_when_needed) it is freed; else TE keeps its buffer
    to write the next one into (and a tensor without row-wise bytes keeps its transposed ones: its data)."""
    quantizer = getattr(w, "_quantizer", None)
    if w._data is not None and quantizer is not None and not quantizer.columnwise_usage:
        w.remove_caches()
    else:
        w._reset_caches()


def transpose_when_needed(w) -> None:
    """Have TE derive an FP8 weight's transpose only where a GEMM needs it (the backward's data gradient on GPUs
    whose FP8 GEMMs take one layout) instead of in every forward: its quantizer makes the row-wise layout
    alone, and what it cached is freed. The transposes then wait from a block's backward to the optimizer's
    next write, not through the forward's peak."""
    w._quantizer.set_usage(rowwise=True, columnwise=False)
    written_in_place(w)


def e4m3_current(t: torch.Tensor, transpose: bool = False):
    """(t in float8_e4m3fn scaled to its own amax, its transpose or None, the FP32 scale that undoes them):
    TE's current-scaling cast (one amax pass, one fused cast[-transpose] pass)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, t.device, rowwise=True, columnwise=transpose)(t)
    data = q._data.view(torch.float8_e4m3fn)
    return data, q._transpose.view(torch.float8_e4m3fn) if transpose else None, q._scale_inv
