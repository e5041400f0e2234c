"""The FP8 policy: what the [fp8] section means for every part that asks.

Models ask which blocks get FP8 weights and compute (`block_fp8`, `block_init`), what the output head runs
in FP8 (`head`); the parallelism asks whether a block must keep its gathered weights (`keeps_gathered`) and
tells it which units it keeps gathered from forward to backward (`gathered_until_backward`); the optimizer
asks for a weight's value before it was quantized (`init_value`); the trainer says when the model is built
(`model_built`: fp8.fused_swiglu) and when its weights are initialized (`weights_initialized`), and the
training step enters `autocast()` and asks whether a run's first step needs a calibration pass
(`needs_calibration`).
Nothing else reads fp8.* options or marks tensors and modules for one another.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from titan_te.te import tensors
from titan_te.te.recipes import RECIPES
from titan_te.te.stats import gradient_scales_set

logger = logging.getLogger("titan_te")


def fp8_block(fcfg, layer_id: int, n_layers: int) -> bool:
    """Whether block `layer_id` of `n_layers` runs in FP8 under the [fp8] section `fcfg` (fp8.bf16_layers keeps
    some in bf16; negative ids count back). The planner asks it too, without building a policy."""
    return fcfg.enable and layer_id not in {i % n_layers for i in fcfg.bf16_layers}


class FP8Policy:
    def __init__(self, fcfg, amax_group=None):
        self.enabled = fcfg.enable
        spec = RECIPES.get(fcfg.recipe) if fcfg.enable else None
        self.recipe = spec.build(fcfg) if spec else None
        self._calibrates = bool(spec and spec.scales_from_history and fcfg.calibrate_first_step)
        self._fused_swiglu = bool(spec and spec.scales_from_history and fcfg.fused_swiglu)
        self.amax_group = amax_group
        self.weights = fcfg.enable and fcfg.params  # FP8 weights (TE's quantized_model_init)
        self._backward_transposes = self.weights and fcfg.backward_transposes
        self.head = fcfg.head if fcfg.enable else "off"  # the fused head's FP8 GEMMs (fp8.head)
        self._fcfg = fcfg
        self._keep_init = fcfg.enable and fcfg.params and fcfg.preserve_high_precision_init
        self._init_values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._fp8_weight_blocks: set[int] = set()

    # --- models ---------------------------------------------------------------------------------------
    def block_fp8(self, layer_id: int, n_layers: int) -> bool:
        """Whether block `layer_id` runs in FP8 (fp8_block)."""
        return fp8_block(self._fcfg, layer_id, n_layers)

    def block_init(self, layer_id: int, n_layers: int):
        """The context to build block `layer_id` in: FP8 weights when fp8.params is on and the block is FP8."""
        if not (self.weights and self.block_fp8(layer_id, n_layers)):
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        return te.quantized_model_init(enabled=True, recipe=self.recipe)

    def built(self, block, layer_id: int, n_layers: int) -> None:
        """A model tells the policy which module holds block `layer_id` (for keeps_gathered)."""
        if self.weights and self.block_fp8(layer_id, n_layers):
            self._fp8_weight_blocks.add(id(block))

    def model_built(self, model) -> None:
        """The whole model is built: with fp8.fused_swiglu its SwiGLU MLPs compute SwiGLU's derivative with its FP8
        cast in one kernel (te/swiglu.py; a one-pass cast needs the scale before the data, which delayed scaling
        has)."""
        from titan_te.te import swiglu

        if not self._fused_swiglu:
            swiglu.uninstall()
            return
        n = swiglu.install(model)
        if not n:
            logger.warning("fp8.fused_swiglu: this model has no TE SwiGLU MLP without biases; TE's kernels run")
            return
        differs = swiglu.differs_from_te(torch.device("cuda", torch.cuda.current_device()))
        if differs:
            import triton

            swiglu.uninstall()
            logger.warning(f"fp8.fused_swiglu: on this machine (Triton {triton.__version__}) the fused kernel's "
                           f"output is wrong: {differs}; TE's kernels run")
            return
        logger.info(f"fp8.fused_swiglu: {n} SwiGLU MLPs compute SwiGLU's derivative with its FP8 cast in one kernel "
                    f"(checked against TE's on this machine)")

    def fp8_weights(self, model):
        """(name, parameter) of every weight that is or will be FP8: on the meta device TE's weights are still
        high precision (reset_parameters quantizes them after sharding); TE quantizes a block's GEMM weights,
        its 2-D parameters."""
        for name, module in model.named_modules():
            if id(module) in self._fp8_weight_blocks:
                for pname, p in module.named_parameters():
                    if p.dim() == 2:
                        yield f"{name}.{pname}", p

    def weights_initialized(self, model) -> None:
        """The FP8 weights are materialized and written (TE's reset_parameters has their quantizers make both
        layouts): with fp8.backward_transposes those used in place have TE derive their transposes only where the
        backward needs them (tensors.transpose_when_needed), so no transpose is held through the forward's peak.
        FSDP2's shards (DTensors) are left as they are: TE derives and frees a gathered copy's transpose itself."""
        if not self._backward_transposes:
            return
        used_in_place = [p for _, p in self.fp8_weights(model) if tensors.is_float8(p)]
        for p in used_in_place:
            tensors.transpose_when_needed(p)
        if used_in_place:
            logger.info(f"fp8.backward_transposes: {len(used_in_place)} FP8 weights used in place derive their "
                        f"transposes in the backward")
        else:
            logger.info("fp8.backward_transposes: no FP8 weight is used in place here (FSDP2 derives and frees its "
                        "gathered copies' transposes itself)")

    # --- the training step -----------------------------------------------------------------------------
    def autocast(self):
        """The forward's context; amaxes are reduced over the data-parallel group."""
        if not self.enabled:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        return te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=self.amax_group)

    def needs_calibration(self, model) -> bool:
        """Whether the next step should first run a calibration pass (fp8.calibrate_first_step): delayed scaling
        quantizes each gradient with a scale from the amaxes of the passes before it, and a run's first backward
        has none, so it uses the initial scale of 1, at which E5M2 cannot represent most values of a first step's
        gradients (~1e-5 and below); Adam's first update, a step of about lr in every weight, then follows that
        rounding. One forward and backward whose gradients are discarded records the amaxes first. Asked once
        per training loop (a host sync); False once any gradient scale is set (a resumed run)."""
        return self._calibrates and not gradient_scales_set(model)

    # --- parallelisms ----------------------------------------------------------------------------------
    def keeps_gathered(self, block) -> bool:
        """FSDP2 gathers FP8 weights for the forward in row-wise form only and for the backward in column-wise
        form only when a block reshards after forward; recomputing the forward inside the backward
        (activation checkpointing, of the block or of its MLP) then finds no row-wise data. Such blocks keep their
        gathered weights."""
        return id(block) in self._fp8_weight_blocks and bool(getattr(block, "recomputes_forward", False))

    def gathered_until_backward(self, unit) -> None:
        """FSDP2 keeps `unit`'s gathered weights from its forward to its backward (no reshard after forward).
        Each step's all-gather then writes new FP8 bytes into the same gathered weight, and TE (2.20) keeps
        that weight's transpose from the step before, which the backward's data gradient would use: drop it
        at the start of every forward, after FSDP2 gathered (hooks run in order of registration)."""
        if not self.weights:
            return

        def fresh_transposes(module, args):
            for p in module.parameters():
                if tensors.is_float8(p):  # per-tensor FP8 derives its transpose; block / MX gather both layouts
                    tensors.written_in_place(p)

        for module in unit if isinstance(unit, (list, tuple)) else [unit]:
            module.register_forward_pre_hook(fresh_transposes)

    # --- init and optimizers ---------------------------------------------------------------------------
    def writer(self, write):
        """`write(target, value)` for init that also keeps each FP8 weight's unquantized value, on the CPU, for
        an optimizer that seeds its FP32 masters from it (fp8.preserve_high_precision_init); others as given."""
        if not self._keep_init:
            return write

        def keeping(target, value):
            write(target, value)
            if tensors.is_quantized(target):
                self._init_values[id(target)] = (weakref.ref(target), value.detach().to("cpu", torch.float32))

        return keeping

    def drop_init_values(self) -> None:
        """The weights were overwritten after init (a checkpoint, Hugging Face weights): their values before
        quantization are not the weights' any more and must not seed an optimizer's masters."""
        self._init_values.clear()

    def init_value(self, weight) -> torch.Tensor | None:
        """The value `weight` (a local FP8 shard) was initialized from before quantization, once (then
        dropped), or None."""
        ref, value = self._init_values.pop(id(weight), (None, None))
        return value if ref is not None and ref() is weight else None
