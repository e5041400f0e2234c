"""Layer-backend registry: how one transformer block is built ("torch" or "te")."""
from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


@dataclass
class BackendSpec:
    name: str
    block: Callable  # block(args, layer_id, fp8=FP8Context|None, params_dtype=...) -> nn.Module
    available: Callable[[], str]  # "" when usable here, else the reason it is not
    materialize: Callable | None = None  # materialize(model, device) after sharding; default to_empty
    write: Callable | None = None  # write(param_local, value) for init; default copy_
    # document_mask(doc_start [batch, seq] bool) -> what the blocks take as `mask` so that attention
    # stays inside each packed document (model.document_mask)
    document_mask: Callable | None = None
    needs_cuda: bool = False  # runs only with training.device = cuda
    fp8: bool = False  # runs linear layers in FP8 (fp8.enable)
    install: str = ""  # how to install what `available()` misses
    compiles_blocks: bool = True  # torch.compile can trace its blocks (else compile.enable does nothing)


BACKENDS: Registry[BackendSpec] = Registry("layer backend")

from titan_te.layers import torch_block, te_block  # noqa: E402,F401  (register both)
