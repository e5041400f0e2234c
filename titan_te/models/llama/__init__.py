"""Llama 3, one package: args and flavors (args.py), the model shell and RoPE (model.py), its block on each
layer backend (torch_block.py, te_block.py), its fused output head and cross-entropy kernel (head.py,
ce_kernel.py), its Hugging Face adapter (hf.py). Registered here as `llama3`."""
from titan_te.models import MODELS, ModelSpec
from titan_te.models.llama.args import FLAVORS, LlamaArgs, check, resolve_args  # noqa: F401
from titan_te.models.llama.hf import LlamaHF
from titan_te.models.llama.model import BLOCKS, Llama, build_llama, fsdp_units, rope_angles  # noqa: F401

# TE module name (last part of its path) -> the layer group its FP8 statistics are reported under
FP8_STAT_GROUPS = {"layernorm_qkv": "attention_qkv", "proj": "attention_proj", "layernorm_mlp": "mlp"}

MODELS.register("llama3")(ModelSpec(name="llama3", flavors=FLAVORS, build=build_llama, resolve_args=resolve_args,
                                    backends=tuple(BLOCKS), hf=LlamaHF(), computes_loss=True, fp8_head=True,
                                    fsdp_units=fsdp_units, check=check, fp8_stat_groups=FP8_STAT_GROUPS))
