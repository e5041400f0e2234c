"""The training loss from full logits: cross-entropy summed over the valid tokens (labels IGNORE_INDEX are
not counted). A family whose forward computes its own loss (ModelSpec.computes_loss) does not use this."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid (not ignored) tokens, from full logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)
