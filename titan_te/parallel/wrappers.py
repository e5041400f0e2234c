"""Per-block wrappers applied before sharding: activation checkpointing and torch.compile."""
from __future__ import annotations

import logging

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

logger = logging.getLogger("titan_te")


def recomputed(layer_id: int, mode: str, every_n: int) -> bool:
    """Whether activation checkpointing in `mode` recomputes (some of) block `layer_id`: every block (full),
    every N-th (every_n; mlp: its MLP's first half), none."""
    return mode != "none" and layer_id % (1 if mode == "full" else every_n) == 0


def apply_activation_checkpoint(model, acfg) -> None:
    """Recompute the activations of the blocks `recomputed` chooses in backward."""
    for key, block in list(model.layers.items()):
        if not recomputed(int(key), acfg.mode, acfg.every_n):
            continue
        if acfg.mode == "mlp":  # blocks of backends with recomputes_mlp only (hardware.py refuses the others)
            block.enable_activation_checkpoint(mlp_only=True)
        elif hasattr(block, "enable_activation_checkpoint"):  # the block brings its own (TE's checkpoint)
            block.enable_activation_checkpoint()
        else:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model, backend: str) -> None:
    """torch.compile each block in place (names unchanged). TE blocks stay eager."""
    from titan_te.layers import BACKENDS

    if not BACKENDS.get(backend).compiles_blocks:
        logger.info(f"compile: {backend} blocks stay eager (compile.enable has no effect with this backend)")
        return
    for block in model.layers.values():
        block.compile(fullgraph=False)
