"""Validation: every `validation.freq` steps, `validation.steps` global batches of held-out data, no gradients.

The held-out batches are the same every time (unshuffled, from the start of the split), so the
curve shows the model's progress and not the sampling noise; the loss is the mean over all valid
tokens of all data-parallel ranks. They are counted in the run's global batches and dealt to the ranks as
training batches are, so a token source gives the same held-out sequences, and the same loss, on any number of
ranks (a run resumed on other GPUs continues its curve); a streamed source splits its own by rank.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_te.data.loader import DataPosition, build_dataloader
from titan_te.loss import IGNORE_INDEX


class Validator:
    def __init__(self, vcfg, source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, global_batch: int,
                 pin_memory: bool, device: torch.device):
        self.cfg, self.device = vcfg, device
        self.micro_batches = vcfg.steps * (global_batch // (batch_size * dp_world))  # this rank's share
        self.loader = build_dataloader(source, seq_len, batch_size, dp_rank, dp_world, seed=0, shuffle=False,
                                       num_workers=0, pin_memory=pin_memory, global_batch=global_batch)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    @torch.no_grad()
    def run(self, model: nn.Module, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """The mean loss over the held-out batches; `loss_sum(input, labels)` runs the forward (of `model`,
        which is put in eval mode meanwhile) and returns the summed cross-entropy of the valid tokens."""
        self.loader.dataset.start_at(DataPosition())  # the same batches every time
        model.eval()
        total = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        batches = iter(self.loader)
        for _ in range(self.micro_batches):
            batch = next(batches)
            inp, labels = batch["input"].to(self.device), batch["labels"].to(self.device)
            total += loss_sum(inp, labels)
            tokens += (labels != IGNORE_INDEX).sum()
        model.train()
        both = torch.stack([total, tokens.float()])
        dist.all_reduce(both)
        return (both[0] / both[1].clamp(min=1)).item()
