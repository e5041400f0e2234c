"""fused_adam against torch.optim.AdamW: FSDP2 shards on 2 gloo ranks, BF16 with masters, the trainer."""
import pytest
import torch

from helpers import make_cfg, run_ranks

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 8, bias=False),
                               torch.nn.LayerNorm(8))


def _groups(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": HP["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]


def _fsdp_vs_adamw(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_te.optim.fused_adam import FusedAdam

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    ref, sharded = _model(), _model()
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt_ref = torch.optim.AdamW(_groups(ref), **{k: v for k, v in HP.items() if k != "weight_decay"})
    opt = FusedAdam(_groups(sharded), **{k: v for k, v in HP.items() if k != "weight_decay"})
    for step in range(10):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))  # same batch on every rank
        for m, o in ((ref, opt_ref), (sharded, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    worst = max((a.full_tensor() - b).abs().max().item()
                for a, b in zip(sharded.parameters(), ref.parameters()))
    kinds = sorted({b.kind for b in opt._buckets})
    return worst, kinds


def test_fused_adam_on_fsdp2_shards_matches_adamw_on_the_full_model():
    for worst, kinds in run_ranks(_fsdp_vs_adamw, 2):
        assert kinds == ["fp32"]
        assert worst < 1e-6


def test_bf16_weights_with_fp32_masters_track_an_fp32_reference():
    from titan_te.optim.fused_adam import FusedAdam

    ref = _model()
    low = _model().to(torch.bfloat16)
    for p, q in zip(ref.parameters(), low.parameters()):
        p.data.copy_(q.data.float())  # the same starting values
    opt_ref = torch.optim.AdamW(_groups(ref), **{k: v for k, v in HP.items() if k != "weight_decay"})
    opt = FusedAdam(_groups(low), **{k: v for k, v in HP.items() if k != "weight_decay"}, master_weights=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        for p, q in zip(ref.parameters(), low.parameters()):
            g = torch.randn(p.shape, generator=gen).bfloat16()
            p.grad, q.grad = g.float(), g
        opt_ref.step()
        opt.step()
    for p, q in zip(ref.parameters(), low.parameters()):
        master = opt.state[q]["master_param"]
        assert master.dtype == torch.float32
        assert (master - p).abs().max().item() < 1e-6  # the master carries the exact FP32 trajectory
        assert torch.equal(q, p.bfloat16())  # the weight is its round-to-nearest BF16 image
        assert opt.state[q]["exp_avg"].dtype == torch.float32


def test_bf16_moments_are_stored_in_bf16_and_close_to_fp32_moments():
    from titan_te.optim.fused_adam import FusedAdam

    a, b = _model(), _model()
    opt_a = FusedAdam(_groups(a), **{k: v for k, v in HP.items() if k != "weight_decay"})
    opt_b = FusedAdam(_groups(b), **{k: v for k, v in HP.items() if k != "weight_decay"},
                      moment_dtype=torch.bfloat16)
    x = torch.randn(4, 16)
    for _ in range(5):
        for m, o in ((a, opt_a), (b, opt_b)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert opt_b.state[q]["exp_avg"].dtype == torch.bfloat16
        assert (p - q).abs().max().item() < 2e-3


def test_unsupported_combinations_are_refused_with_the_option_named():
    from titan_te.errors import ConfigError
    from titan_te.optim.fused_adam import FusedAdam

    low = _model().to(torch.bfloat16)
    with pytest.raises(ConfigError, match="store_param_remainders needs CUDA and Transformer Engine"):
        FusedAdam(low.parameters(), store_param_remainders=True)
    with pytest.raises(ConfigError, match="not supported"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])


def _train(rank, world, tmp, name):
    from titan_te.trainer import Trainer

    tr = Trainer(make_cfg(tmp, world=world, training={"steps": 10, "deterministic": True,
                                                      "global_batch_size": 4},
                          optimizer={"name": name}))
    losses = tr.train()
    tr.close()
    return losses


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_losses_with_fused_adam_equal_adamw(tmp_path, world):
    adamw = run_ranks(_train, world, str(tmp_path / "a"), "adamw")[0]
    fused = run_ranks(_train, world, str(tmp_path / "f"), "fused_adam")[0]
    assert len(fused) == 10 and fused[-1] < fused[0]
    assert fused == pytest.approx(adamw, rel=1e-5)


def test_clipping_inside_the_step_equals_a_clipping_pass_before_it():
    """clip_grad_norm hands fused_adam the clip coefficient; the update equals clipping the gradients first."""
    from titan_te.optim.fused_adam import FusedAdam
    from titan_te.train_utils import clip_grad_norm

    models = [_model(), _model()]
    opts = [FusedAdam(_groups(m), **{k: v for k, v in HP.items() if k != "weight_decay"}) for m in models]
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        norms = []
        for i, (m, o) in enumerate(zip(models, opts)):
            (m(x).square().mean() * 100).backward()  # large gradients: clipping is active
            norms.append(clip_grad_norm(m.parameters(), 0.5, o if i else None).item())
            o.step()
            o.zero_grad()
        assert norms[0] == norms[1] and norms[0] > 0.5
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_a_broken_transformer_engine_is_one_line_not_a_silent_slow_path(tmp_path, monkeypatch):
    """fused_adam used to fall back to torch's math whenever importing TE raised anything; an installed but
    broken TE (a wrong CUDA build) is now the user's one line, a missing one a warning."""
    import sys

    import torch

    from titan_te.errors import ConfigError
    from titan_te.optim import fused_adam

    fake = tmp_path / "transformer_engine"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="Transformer Engine is installed but cannot be loaded .OSError: libcudart"):
        fused_adam._te_kernels()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["fp32 weight", "bf16 weight", "moment", "step"])
def test_the_training_state_check_finds_one_bad_value_anywhere(bad, where):
    """training_state_finite (before every save and at a loop's end) finds a single NaN, +inf or -inf in any
    weight's or optimizer state's tensor, whatever its dtype, and passes a finite state with an empty shard."""
    from titan_te.train_utils import training_state_finite

    model = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 32), "b": torch.nn.Linear(32, 8).to(torch.bfloat16)})
    model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))  # an FSDP2 shard can be empty
    opt = torch.optim.AdamW(model.parameters())
    model["a"](torch.randn(2, 64)).sum().backward()
    model["b"](torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert training_state_finite(model, opt)
    target = {"fp32 weight": model["a"].weight, "bf16 weight": model["b"].weight,
              "moment": opt.state[model["a"].weight]["exp_avg_sq"], "step": opt.state[model["b"].bias]["step"]}[where]
    with torch.no_grad():
        target.view(-1)[target.numel() // 2] = bad
    assert not training_state_finite(model, opt)


def test_bf16_gradients_of_fp32_weights_update_as_their_values_in_fp32_do():
    """model.wgrad_dtype = bfloat16 hands clipping and fused_adam bf16 gradients of FP32 weights (`grad_dtype`):
    the norm (taken in FP32) and the update equal those of FP32 gradients holding the same bf16 values."""
    from titan_te.optim.fused_adam import FusedAdam
    from titan_te.train_utils import clip_grad_norm

    models = [_model(), _model()]
    opts = [FusedAdam(_groups(m), **{k: v for k, v in HP.items() if k != "weight_decay"}) for m in models]
    for p in models[1].parameters():
        p.grad_dtype = torch.bfloat16
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        norms = []
        for i, (m, o) in enumerate(zip(models, opts)):
            (m(x).square().mean() * 100).backward()
            for p in m.parameters():
                low, p.grad = p.grad.bfloat16(), None
                p.grad = low if i else low.float()
            norms.append(clip_grad_norm(m.parameters(), 0.5, o).item())
            assert {p.grad.dtype for p in m.parameters()} == {torch.bfloat16 if i else torch.float32}
            o.step()
            o.zero_grad()
        assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > 0.5
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
