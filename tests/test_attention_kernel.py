"""model.attention_kernel on the te backend, what can be checked without a GPU: TE's switches for the process, the
FlashAttention package found, and the one-line refusal of `flash` without one (GPU runs: tests/test_te_gpu.py)."""
import os
import sys
import types

import pytest

from titan_te.te import attention


@pytest.fixture
def switches(monkeypatch):
    """TE's backend switches and its backend cache, as a fake module: use() marks the cache stale."""
    for name in ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"):
        monkeypatch.delenv(name, raising=False)
    cache = {"backend_selection_requires_update": False, "wrapped": 0}
    monkeypatch.setattr(attention, "_backends", lambda: cache)
    monkeypatch.setattr(attention, "_unbounded_windows_as_none", lambda: cache.update(wrapped=cache["wrapped"] + 1))
    return cache


@pytest.mark.parametrize("kernel, env", [("cudnn", {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"}),
                                         ("flash", {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1"})])
def test_a_kernel_sets_tes_switches_and_marks_its_choice_stale(kernel, env, switches):
    attention.use(kernel)
    assert {k: os.environ[k] for k in env} == env and switches["backend_selection_requires_update"]
    assert switches["wrapped"] == (kernel == "flash")  # FA4's window edges fixed for flash only


def test_auto_leaves_the_switches_as_the_environment_set_them(switches, monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    attention.use("auto")
    assert os.environ["NVTE_FUSED_ATTN"] == "0" and "NVTE_FLASH_ATTN" not in os.environ
    assert not switches["backend_selection_requires_update"]


def test_ran_says_which_backend_te_chose(switches):
    switches.update(use_flash_attention=False, use_fused_attention=True, fused_attention_backend=1)
    assert attention.ran() == "cuDNN fused attention (sub-backend 1)"
    switches.update(use_flash_attention=True, flash_attention_backend="4.0.0b36")
    assert attention.ran() == "FlashAttention 4.0.0b36"


def test_flash_needs_a_flashattention_package(monkeypatch):
    monkeypatch.setattr(attention, "_importable", lambda name: False)
    assert attention.flash_package() == "" and "pip install flash-attn-4" in attention.missing("flash")
    assert attention.missing("cudnn") == "" and attention.missing("auto") == ""
    monkeypatch.setattr(attention, "_importable", lambda name: name == "flash_attn.cute")
    assert attention.flash_package() == "flash-attn-4" and attention.missing("flash") == ""


def test_a_missing_parent_package_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it fails, as a missing package does
    assert not attention._importable("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert not attention._importable("flash_attn.cute")


def test_flashattention_2s_unbounded_window_edges_reach_fa4_as_none():
    """TE 2.20.2 passes FA4 a causal window of (-1, 0) in FlashAttention 2's terms; FA4 takes -1 as a window of
    -1 keys (each query then attended to no earlier token: 39% worse loss in 20 steps on an H200), None as none."""
    assert attention.window_edges((-1, 0)) == (None, 0)
    assert attention.window_edges((-1, -1)) == (None, None)
    assert attention.window_edges((None, None)) == (None, None)
    assert attention.window_edges((128, 0)) == (128, 0)  # a real sliding window stays
