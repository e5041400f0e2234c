"""Model registry: each entry is a ModelSpec (flavors + a builder)."""
from dataclasses import dataclass
from typing import Any, Callable

from titan_te.registry import Registry


@dataclass
class ModelSpec:
    name: str
    flavors: dict[str, Any]  # flavor name -> model args dataclass
    build: Callable[..., Any]  # build(args, backend_name) -> nn.Module (call under the meta device)


MODELS: Registry[ModelSpec] = Registry("model")

from titan_te.models import llama  # noqa: E402,F401  (registers llama3)
