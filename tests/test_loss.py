"""The fused, chunked output head + cross-entropy against full logits."""
import pytest
import torch
import torch.nn.functional as F

from helpers import run_ranks
from test_options import _losses
from titan_te.loss import IGNORE_INDEX, token_loss_sum
from titan_te.models.llama.head import chunk_tokens, linear_cross_entropy_sum


def _inputs(tokens=70, dim=16, vocab=50, ignored=(3, 4, 69)):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[list(ignored)] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.parametrize("chunk", [7, 32, 70, 1000], ids=["uneven-chunks", "three-chunks", "one-chunk", "bigger"])
def test_fused_head_matches_full_logits_in_loss_and_both_gradients(chunk):
    h, w, labels = _inputs()
    # float64 reference; the fused head takes its softmax in FP32, as it does on the GPU
    ref = F.cross_entropy(h @ w.t(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
    ref_h, ref_w = torch.autograd.grad(ref * 0.37, (h, w))  # a scaled loss, as the trainer divides by tokens
    fused = linear_cross_entropy_sum(h, w, labels, chunk=chunk)
    got_h, got_w = torch.autograd.grad(fused * 0.37, (h, w))
    assert fused.item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 loss accumulation
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    assert got_h[[3, 4, 69]].abs().max().item() == 0.0  # ignored tokens get no gradient


def test_fused_head_without_gradients_and_with_all_tokens_ignored():
    h, w, labels = _inputs()
    with torch.no_grad():
        assert linear_cross_entropy_sum(h, w, labels, chunk=16).item() == pytest.approx(
            token_loss_sum((h @ w.t()).unsqueeze(0), labels.unsqueeze(0)).item(), rel=1e-6)
    none = torch.full_like(labels, IGNORE_INDEX)
    loss = linear_cross_entropy_sum(h, w, none, chunk=16)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0 and gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_chunk_size_keeps_fp32_logits_within_the_budget():
    assert chunk_tokens(128256, 32768) == 4096  # 4096 x 128,256 x 4 B = 1.96 GiB
    assert chunk_tokens(258, 2048) == 2048  # a small vocabulary: one chunk
    assert chunk_tokens(10**9, 100) == 100  # never below one row of work
    assert chunk_tokens(128256, 32768, kernel=True) == 8320  # bf16 logits in place: twice the tokens (2 GiB)


def test_training_with_the_fused_head_gives_the_losses_of_full_logits(tmp_path):
    fused = run_ranks(_losses, 1, str(tmp_path / "a"), {})[0]
    full = run_ranks(_losses, 1, str(tmp_path / "b"), {"model": {"fused_loss": False}})[0]
    assert len(fused) == 4 and fused == pytest.approx(full, rel=1e-5)
    assert fused[-1] < fused[0]


@pytest.mark.gpu
def test_triton_rows_match_torch_rows_in_bf16():
    """The CUDA path (Triton kernel, FP32-accumulated weight gradient) against torch ops, bf16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(50000, 256, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, 50000, (3000,), device="cuda", generator=g)
    labels[::7] = IGNORE_INDEX
    out = {}
    for kernel in (True, False):
        loss = linear_cross_entropy_sum(h, w, labels, chunk=1024, kernel=kernel)
        out[kernel] = (loss.detach(), *torch.autograd.grad(loss / 2571, (h, w)))
    (lk, hk, wk), (lt, ht, wt) = out[True], out[False]
    print(f"loss kernel {lk.item():.4f} torch {lt.item():.4f}")
    assert abs(lk.item() - lt.item()) / lt.item() < 1e-5
    assert hk[::7].abs().max().item() == 0.0
    torch.testing.assert_close(hk.float(), ht.float(), rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(wk.float(), wt.float(), rtol=2e-2, atol=1e-5)


@pytest.mark.gpu
def test_fp8_head_modes_against_the_bf16_head():
    """fp8.head: "dgrad" keeps the loss and the weight gradient of the bf16 head exactly and moves the
    gradient into the model by FP8 rounding only; "all" moves the loss by FP8 rounding of the logits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(32064, 512, device="cuda", generator=g) * 0.05).requires_grad_()  # FP32, as the model's
    labels = torch.randint(0, 32064, (4096,), device="cuda", generator=g)
    labels[::5] = IGNORE_INDEX
    out = {}
    for mode in ("off", "dgrad", "all"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy_sum(h, w, labels, chunk=1536, fp8=mode)
        out[mode] = (loss.detach(), *torch.autograd.grad(loss / 3276, (h, w)))
    (lo, ho, wo) = out["off"]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for mode in ("dgrad", "all"):
        lm, hm, wm = out[mode]
        print(f"fp8.head={mode}: loss {lm.item():.5f} vs {lo.item():.5f}, grad_h rel {rel(hm, ho):.2e}, "
              f"grad_w rel {rel(wm, wo):.2e}")
        assert hm[::5].abs().max().item() == 0.0  # ignored tokens get no gradient
        assert rel(hm, ho) < 0.08
    ld, hd, wd = out["dgrad"]
    assert ld.item() == lo.item() and rel(wd, wo) < 1e-5  # the same bf16 GEMMs
    la, ha, wa = out["all"]
    assert abs(la.item() - lo.item()) / lo.item() < 5e-3 and rel(wa, wo) < 0.08
