"""The `fp8` checkpoint part: TE's delayed-scaling state (scales, amax history) of every FP8 module."""
from __future__ import annotations

import contextlib
import os
import pickle

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

EXTRA_STATE = "_extra_state"  # the state_dict key suffix of a module's extra state (torch's), where TE keeps it
TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


class FP8Part:
    """Transformer Engine's delayed-scaling state (scales, amax history) of every FP8 module, a checkpoint part
    (checkpoint/parts.py registers it as "fp8"). It differs in size across ranks inside the sharded model state,
    so it is kept out of it and saved once; the amax reduction over the data-parallel group keeps every rank's
    scales equal."""

    name, resharding = "fp8", "replicated"

    def __init__(self, model):
        self.model = model

    def _extra(self) -> dict:
        return {k: v for k, v in get_model_state_dict(self.model).items() if k.endswith(EXTRA_STATE)}

    def present(self) -> bool:
        return bool(self._extra())

    def state_dict(self):
        return pickle.dumps({k: v.cpu() if torch.is_tensor(v) else v for k, v in self._extra().items()})

    def size_bytes(self) -> int:
        return len(self.state_dict())

    def load_target(self):
        return b""

    def load_state_dict(self, state) -> None:
        own = self._extra()
        extra = pickle.loads(state)
        with _allow_te_pickle():
            self.model.load_state_dict({k: v for k, v in extra.items() if k in own}, strict=False)


@contextlib.contextmanager
def _allow_te_pickle():
    """TE refuses to unpickle its extra state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. The copy
    loaded here was pickled by titan_te into the run's own checkpoint, like the rng and dataloader parts."""
    old = os.environ.get(TE_UNSAFE_PICKLE)
    os.environ[TE_UNSAFE_PICKLE] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TE_UNSAFE_PICKLE, None)
        else:
            os.environ[TE_UNSAFE_PICKLE] = old
