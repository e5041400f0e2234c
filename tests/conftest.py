import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one thread each, their child processes too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _te_gpu_missing() -> str:
    """Why the gpu-marked tests cannot run here ("" when they can): the skip reason names it, so a GPU run whose
    Transformer Engine failed to import says how (a run of two suites at once once skipped one of them)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:
        return f"Transformer Engine did not import: {type(e).__name__}: {e}"
    return ""


def pytest_collection_finish(session):
    """What is imported by now (torch, the package, the test modules) lives as long as this process: frozen out
    of the garbage collector's scans, every full collection (titan_te's shutdown runs one after each run) walks
    only what the tests made since."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(config, items):
    missing = _te_gpu_missing()
    if not missing:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU with Transformer Engine ({missing}; run with -m gpu on a GPU)")
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


@pytest.fixture(autouse=True)
def _fresh_titan_te_logger():
    """main() run in-process sets up console logging (propagate off); the next test's caplog needs it on."""
    import logging

    log = logging.getLogger("titan_te")
    yield
    log.handlers.clear()
    log.propagate = True


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a real tmpfs of that size (e.g. "2m") at tmp_path/disk, unmounted after the test: disk-full
    cases hit the kernel's ENOSPC, never a mocked exception. Needs root (as CI and the dev machines run)."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = []

    def mount(size: str) -> Path:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


def without_root_override(argv: list[str]) -> list[str]:
    """argv run as root without the capabilities that let root read and write anything (chmod 000 then
    means what it means for every other user)."""
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *argv]


@pytest.fixture(autouse=True)
def _gpu_runs_leave_no_checkpoints(request):
    """A GPU test's 1B-wide checkpoints take gigabytes each, and the GPU files run side by side on one disk:
    a GPU test's folder goes when the test ends, pass or fail."""
    yield
    folder = request.node.funcargs.get("tmp_path") if "gpu" in request.keywords else None
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
