"""Llama's Hugging Face adapter: HF LlamaForCausalLM safetensors <-> our parameter names (TE layout).

Mapping per block i (HF name <- ours):
  input_layernorm            <- self_attention.layernorm_qkv.layer_norm_weight
  q_proj, k_proj, v_proj     <- self_attention.layernorm_qkv.weight (per KV group: [q heads, k, v])
  o_proj                     <- self_attention.proj.weight
  post_attention_layernorm   <- layernorm_mlp.layer_norm_weight
  gate_proj, up_proj         <- layernorm_mlp.fc1_weight ([gate; up])
  down_proj                  <- layernorm_mlp.fc2_weight
Both sides use the rotate-half RoPE layout, so q/k need no permutation.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from safetensors import SafetensorError

from titan_te.hf_files import read_hf_folder
from titan_te.init_weights import local_shard, local_tensor

def export_args(args, state: dict, seq_len: int):
    """The flavor's args sized from a checkpoint's full state (its blocks and vocabulary)."""
    from titan_te.errors import ExportError

    layers = [int(k.split(".")[1]) for k in state if k.startswith("layers.")]
    if "tok_embeddings.weight" not in state or not layers:
        raise ExportError("the checkpoint holds no Llama model weights")
    return replace(args, vocab_size=state["tok_embeddings.weight"].shape[0], n_layers=1 + max(layers),
                   max_seq_len=max(args.max_seq_len, seq_len))


def to_hf(sd: dict, args) -> dict:
    """Our full (unsharded) model state -> HF LlamaForCausalLM tensors."""
    hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["output.weight"]}
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "self_attention.layernorm_qkv.weight"].view(nkv, nh // nkv + 2, hd, args.dim)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :-2].reshape(nh * hd, args.dim)
        out[h + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(nkv * hd, args.dim)
        out[h + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(nkv * hd, args.dim)
        out[h + "self_attn.o_proj.weight"] = sd[p + "self_attention.proj.weight"]
        out[h + "input_layernorm.weight"] = sd[p + "self_attention.layernorm_qkv.layer_norm_weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "layernorm_mlp.layer_norm_weight"]
        gate, up = sd[p + "layernorm_mlp.fc1_weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = sd[p + "layernorm_mlp.fc2_weight"]
    return {k: v.contiguous() for k, v in out.items()}


_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def hf_names(args) -> set[str]:
    """The HF tensor names a model of `args` reads (and writes)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    return names | {f"model.layers.{i}.{k}" for i in range(args.n_layers) for k in _LAYER_KEYS}


def unexpected_hf_names(hf: dict, args) -> list[str]:
    """Tensors in an HF folder this model would silently drop (rotary caches are not weights)."""
    return sorted(k for k in set(hf) - hf_names(args) if not k.endswith("rotary_emb.inv_freq"))


def from_hf(hf: dict, args) -> dict:
    """HF LlamaForCausalLM tensors -> our full model state."""
    hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
    sd = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
          "output.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"])}
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q = hf[h + "self_attn.q_proj.weight"].view(nkv, nh // nkv, hd, args.dim)
        k = hf[h + "self_attn.k_proj.weight"].view(nkv, 1, hd, args.dim)
        v = hf[h + "self_attn.v_proj.weight"].view(nkv, 1, hd, args.dim)
        sd[p + "self_attention.layernorm_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, args.dim)
        sd[p + "self_attention.proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        sd[p + "self_attention.layernorm_qkv.layer_norm_weight"] = hf[h + "input_layernorm.weight"]
        sd[p + "layernorm_mlp.layer_norm_weight"] = hf[h + "post_attention_layernorm.weight"]
        sd[p + "layernorm_mlp.fc1_weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"],
                                                        hf[h + "mlp.up_proj.weight"]], dim=0)
        sd[p + "layernorm_mlp.fc2_weight"] = hf[h + "mlp.down_proj.weight"]
    return sd


def hf_config(args, dtype: str) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "num_hidden_layers": args.n_layers, "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }
    if args.rope_scaling_factor != 1.0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_pos}
    return cfg


HF_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@torch.no_grad()
def load_hf_weights(model, folder: str, write=None) -> None:
    """Load a HF Llama folder into a (possibly sharded) model, each rank copying its own shard."""
    from titan_te.errors import ConfigError

    try:
        hf = read_hf_folder(Path(folder))
        odd = sorted((k, t.dtype) for k, t in hf.items() if t.dtype not in HF_WEIGHT_DTYPES)
        if odd:
            raise ConfigError(f"checkpoint.initial_load_path: {odd[0][0]} is {str(odd[0][1]).replace('torch.', '')} "
                              f"in {folder} ({len(odd)} such tensor(s)); weights to start from are float32, bfloat16 "
                              f"or float16 (a quantized folder needs its own loader)")
        extra = unexpected_hf_names(hf, model.args)
        if extra:
            layers = {int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")}
            raise ConfigError(f"checkpoint.initial_load_path = {folder} holds tensors this model has no place for "
                              f"({len(extra)}, e.g. {', '.join(extra[:3])}): it has {len(layers)} layers, the "
                              f"model {model.args.n_layers}; set --model.n_layers (and the flavor) to match it")
        sd = from_hf(hf, model.args)
    except (OSError, KeyError, RuntimeError, ValueError, AttributeError, SafetensorError) as e:
        raise ConfigError(f"checkpoint.initial_load_path = {folder}: not a Llama safetensors folder matching "
                          f"this model ({type(e).__name__}: {e})") from None
    for name, p in model.named_parameters():
        from titan_te.init_weights import clean_name

        full = sd[clean_name(name)]
        if tuple(full.shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint.initial_load_path: {name} has shape {tuple(full.shape)} in {folder}, "
                              f"the model expects {tuple(p.shape)}")
        target = local_tensor(p)
        whole = full.to(device=target.device, dtype=torch.float32)
        if not bool(torch.isfinite(whole).all()):  # the whole tensor: every rank comes to the same answer
            raise ConfigError(f"checkpoint.initial_load_path: {name} in {folder} holds NaN or infinite values; "
                              f"training from it would be NaN from the first step")
        (write or (lambda t, v: t.copy_(v)))(target, local_shard(whole, p))


class LlamaHF:
    """The adapter on Llama's ModelSpec (models.HFAdapter): export and checkpoint.initial_load_path."""

    export_args = staticmethod(export_args)
    to_hf = staticmethod(to_hf)
    hf_config = staticmethod(hf_config)
    load_hf_weights = staticmethod(load_hf_weights)
