import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_te_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if _has_te_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with Transformer Engine (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_dist_env(monkeypatch):
    """Each in-process test starts outside any torchrun environment."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
