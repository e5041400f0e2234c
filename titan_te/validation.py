"""Validation: every `validation.freq` steps, `validation.steps` batches of held-out data, no gradients.

The held-out batches are the same every time (unshuffled, from the start of the split), so the
curve shows the model's progress and not the sampling noise; the loss is the mean over all valid
tokens of all data-parallel ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from titan_te.data.loader import build_dataloader


class Validator:
    def __init__(self, vcfg, source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, pin_memory: bool):
        self.cfg = vcfg
        self.loader = build_dataloader(source, seq_len, batch_size, dp_rank, dp_world, seed=0, shuffle=False,
                                       num_workers=0, pin_memory=pin_memory)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    @torch.no_grad()
    def run(self, trainer) -> float:
        self.loader.dataset.load_state_dict({"epoch": 0, "position": 0})  # the same batches every time
        model = trainer.train_model
        model.eval()
        loss_sum = torch.zeros((), device=trainer.device)
        tokens = torch.zeros((), device=trainer.device)
        batches = iter(self.loader)
        for _ in range(self.cfg.steps):
            batch = next(batches)
            inp, labels = batch["input"].to(trainer.device), batch["labels"].to(trainer.device)
            logits = trainer.logits(inp)
            loss_sum += trainer.token_loss_sum(logits, labels)
            tokens += (labels != trainer.ignore_index).sum()
        model.train()
        both = torch.stack([loss_sum, tokens.float()])
        dist.all_reduce(both)
        return (both[0] / both[1].clamp(min=1)).item()
