"""The named Stateful parts a checkpoint holds, each saying how it crosses a change of world size.

  sharded     tensors sharded over the data-parallel mesh; DCP reshards them to any world size
  replicated  the same on every rank; written once (by rank 0), loaded by every rank
  per_rank    one entry per rank (RNG, a streamed dataset's position); loads only at the same data-parallel size

`checkpoint.exclude_from_loading` names parts of PARTS. The manager saves `{name: part.state_dict()}`
in one DCP call and loads into `{name: part.load_target()}`, then hands each part its state.
"""
from __future__ import annotations

import json
import logging
import pickle
import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from titan_te.checkpoint import space
from titan_te.init_weights import local_tensor
from titan_te.registry import Registry
from titan_te.te import tensors
from titan_te.te.checkpoint_part import EXTRA_STATE, FP8Part

logger = logging.getLogger("titan_te")

PARTS: Registry[type] = Registry("checkpoint part")
KEPT_FROM_CHECKPOINT = ("params", "step")  # a parameter group's keys that are state, not configuration


class Part:
    name = ""
    resharding = "replicated"  # sharded | replicated | per_rank

    def state_dict(self):
        raise NotImplementedError

    def load_target(self):
        """What DCP loads into (tensors are filled in place, other values replaced)."""
        return self.state_dict()

    def load_state_dict(self, state) -> None:
        raise NotImplementedError

    def size_bytes(self) -> int:
        """What this rank's share of the part puts on disk (the space check, before anything is saved)."""
        return space.state_bytes(self.state_dict())


def _params(model) -> dict:
    return {k: v for k, v in get_model_state_dict(model).items() if not k.endswith(EXTRA_STATE)}


@PARTS.register("model")
class ModelPart(Part):
    name, resharding = "model", "sharded"

    def __init__(self, model, export_dtype: torch.dtype | None = None):
        self.model, self.export_dtype = model, export_dtype

    def state_dict(self):
        return _params(self.model)

    def model_only_state(self):
        """The weights for a model-only save, in `checkpoint.export_dtype`."""
        sd = self.state_dict()
        if self.export_dtype is None:
            return sd
        return {k: v.to(self.export_dtype) if torch.is_floating_point(v) else v for k, v in sd.items()}

    def load_state_dict(self, state) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))


PARTS.register("fp8")(FP8Part)  # TE's FP8 scaling state (titan_te/te/checkpoint_part.py)


@PARTS.register("optimizer")
class OptimizerPart(Part):
    name, resharding = "optimizer", "sharded"

    def __init__(self, model, optimizer, state_bytes):
        """state_bytes(low_precision_weight) -> the optimizer's state bytes per parameter (its spec's), for the
        size of a save before the optimizer has state."""
        self.model, self.optimizer, self.state_bytes = model, optimizer, state_bytes

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def size_bytes(self) -> int:
        """Before the first step the optimizer has no state, and asking torch for its state dict then creates
        it by running a step (lr 0, zero gradients): the step counts, and Adam's bias correction is one step
        off for the whole run. So until then the size comes from the optimizer's bytes per parameter."""
        if self.optimizer.state:
            return super().size_bytes()
        total = 0
        for p in self.model.parameters():
            local = local_tensor(p)
            low = tensors.is_quantized(local) or local.element_size() < 4
            total += int(local.numel() * self.state_bytes(low))
        return total

    def load_state_dict(self, state) -> None:
        """The state (moments, masters, step counts) from the checkpoint; the hyperparameters (lr, betas,
        eps, weight decay ...) stay this run's, so what the user set now applies on resume."""
        configured = [{k: v for k, v in g.items() if k not in KEPT_FROM_CHECKPOINT} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, mine in zip(self.optimizer.param_groups, configured):
            group.update(mine)


@PARTS.register("lr_scheduler")
class LRSchedulerPart(Part):
    name = "lr_scheduler"

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state) -> None:
        """The schedule's position from the checkpoint; its peak lr and shape from this run's config."""
        self.scheduler.load_state_dict(state)
        groups = self.scheduler.optimizer.param_groups
        self.scheduler.base_lrs = [g["initial_lr"] for g in groups]
        for g, base, factor in zip(groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            g["lr"] = base * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in groups]


@PARTS.register("train_state")
class TrainStatePart(Part):
    """Step and token counters, and the data-parallel size that wrote the per-rank parts."""

    name = "train_state"

    def __init__(self, train_state, dp_world: int):
        self.train_state, self.dp_world = train_state, dp_world

    def state_dict(self):
        return {**self.train_state.state_dict(), "dp_world": self.dp_world}

    def load_target(self):
        return {**self.train_state.state_dict(), "dp_world": 0}

    def load_state_dict(self, state) -> None:
        self.train_state.load_state_dict({k: v for k, v in state.items() if k != "dp_world"})


class PerRankPart(Part):
    """Pickled per-rank state stored as {"rank<R>": bytes}."""

    resharding = "per_rank"

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def local_state(self):
        raise NotImplementedError

    def set_local_state(self, state) -> None:
        raise NotImplementedError

    def state_dict(self):
        return {self.key: pickle.dumps(self.local_state())}

    def load_target(self):
        return {self.key: b""}

    def load_state_dict(self, state) -> None:
        self.set_local_state(pickle.loads(state[self.key]))


@PARTS.register("dataloader")
class DataLoaderPart(PerRankPart):
    """Where the data stands. A dataset with a global position (tokens, files, embedded): its DataPosition,
    the same on every rank, written once and loaded on any number of ranks and loader workers. A streamed
    dataset (hf): every rank's loader state, which resumes only on as many ranks and workers."""

    name = "dataloader"

    def __init__(self, dataloader, rank: int, position=None):
        super().__init__(rank)
        self.dataloader, self.position = dataloader, position
        self.resharding = "replicated" if position is not None else "per_rank"

    def state_dict(self):
        if self.position is None:
            return super().state_dict()
        return {**self.position.state_dict(), "order": json.dumps(self.dataloader.dataset.order(), sort_keys=True)}

    def load_target(self):
        return {"epoch": 0, "offset": 0, "order": ""} if self.position is not None else super().load_target()

    def load_state_dict(self, state) -> None:
        if self.position is None:
            return super().load_state_dict(state)
        self.position.load_state_dict(state)
        saved, now = json.loads(state["order"] or "{}"), self.dataloader.dataset.order()
        if saved != now:  # another seq_len, dataset, hold-out, seed or shuffle: the saved offset means nothing here
            changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v)
            logger.warning(f"data: the order of the data changed since the checkpoint ({changed}); training goes on "
                           f"from the start of epoch {self.position.epoch + 1} in the new order")
            self.position.load_state_dict({"epoch": self.position.epoch + 1, "offset": 0})
        self.dataloader.dataset.start_at(self.position)

    def local_state(self):
        return {"num_workers": self.dataloader.num_workers, "loader": self.dataloader.state_dict()}

    def set_local_state(self, state) -> None:
        from titan_te.errors import CheckpointError

        if state["num_workers"] != self.dataloader.num_workers:
            raise CheckpointError(f"this streamed dataset's position was saved with data.num_workers = "
                                  f"{state['num_workers']} and cannot be resharded to {self.dataloader.num_workers}; "
                                  f"resume with --data.num_workers={state['num_workers']}, or start the stream's "
                                  f"order afresh with --checkpoint.exclude_from_loading=dataloader")
        self.dataloader.load_state_dict(state["loader"])


@PARTS.register("rng")
class RNGPart(PerRankPart):
    name = "rng"

    def local_state(self):
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def set_local_state(self, state) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def training_parts(model, optimizer, lr_scheduler, dataloader, train_state, dp_rank: int, dp_world: int,
                   *, optimizer_state_bytes, export_dtype: torch.dtype | None = None,
                   data_position=None) -> dict[str, Part]:
    """The parts of a training run, in the order they are saved and restored; optimizer_state_bytes: see
    OptimizerPart."""
    parts: list[Part] = [ModelPart(model, export_dtype), OptimizerPart(model, optimizer, optimizer_state_bytes),
                         LRSchedulerPart(lr_scheduler), TrainStatePart(train_state, dp_world),
                         DataLoaderPart(dataloader, dp_rank, data_position), RNGPart(dp_rank)]
    fp8 = FP8Part(model)
    if fp8.present():
        parts.append(fp8)
    return {p.name: p for p in parts}
