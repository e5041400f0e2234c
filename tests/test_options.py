"""Options that change training without changing the answer, or change it in a known way."""
import math

import pytest
import torch

from helpers import make_cfg, run_ranks


def test_lr_schedule_values_at_chosen_steps():
    from titan_te.optim.lr_schedule import lr_factor

    # warmup 4 of 20 steps, cosine down to 0.1
    assert [lr_factor(s, 20, 4, "cosine", 0.1) for s in (1, 4)] == [1 / 5, 4 / 5]
    assert lr_factor(5, 20, 4, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 16)))
    assert lr_factor(12, 20, 4, "cosine", 0.1) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(20, 20, 4, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 20, 4, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(30, 20, 4, "linear", 0.2) == pytest.approx(0.2)  # past the end: stays at the minimum
    assert lr_factor(9, 20, 4, "constant", 0.1) == 1.0


def test_max_norm_clips_the_update_to_the_threshold():
    from titan_te.train_utils import clip_grad_norm

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm(params, 0.0).item() == pytest.approx(5.0)  # 0: reported, not clipped
    assert torch.equal(params[1].grad, torch.tensor([0.0, 4.0, 0.0, 0.0]))
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(5.0)  # the norm before clipping
    total = torch.cat([p.grad for p in params]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5) and params[0].grad[0].item() == pytest.approx(0.6, rel=1e-5)


def _losses(rank, world, tmp, sections):
    from titan_te.trainer import Trainer

    base = {"training": {"steps": 4, "deterministic": True}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    with Trainer(make_cfg(tmp, world=world, **base)) as tr:
        return tr.train()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_ranks(_losses, 1, str(tmp_path_factory.mktemp("plain")), {})[0]


@pytest.mark.parametrize("sections", [
    {"activation_checkpoint": {"mode": "full"}},
    {"activation_checkpoint": {"mode": "every_n", "every_n": 2}},
    {"parallelism": {"reshard_after_forward": False}},
    {"parallelism": {"unsharded_one_rank": True}},
], ids=["ac-full", "ac-every-2", "no-reshard-after-forward", "unsharded-one-rank"])
def test_memory_options_keep_the_losses(sections, plain, tmp_path):
    assert run_ranks(_losses, 1, str(tmp_path), sections)[0] == pytest.approx(plain, rel=1e-6)


def test_a_tighter_max_norm_changes_the_losses(plain, tmp_path):
    clipped = run_ranks(_losses, 1, str(tmp_path), {"training": {"max_norm": 0.01}})[0]
    assert clipped[0] == plain[0] and clipped[1:] != pytest.approx(plain[1:], rel=1e-4)


def _parallel_of(rank, world, tmp, sections):
    from torch.distributed.tensor import DTensor

    from titan_te.trainer import Trainer

    with Trainer(make_cfg(tmp, world=world, **sections)) as tr:
        return tr.parallel, any(isinstance(p, DTensor) for p in tr.model.parameters())


def test_fsdp_on_one_rank_shards_unless_unsharded_is_asked_for():
    import tempfile

    unsharded = {"parallelism": {"unsharded_one_rank": True}}
    with tempfile.TemporaryDirectory() as tmp:
        assert run_ranks(_parallel_of, 1, tmp, {})[0] == ("fsdp", True)
        assert run_ranks(_parallel_of, 1, tmp, unsharded)[0] == ("none", False)
        assert run_ranks(_parallel_of, 2, tmp, unsharded)[0] == ("fsdp", True)  # only a world of one


def test_compile_keeps_the_losses(plain, tmp_path):
    """compile.enable: torch.compile of each block (inductor on the CPU) gives the eager losses."""
    compiled = run_ranks(_losses, 1, str(tmp_path), {"compile": {"enable": True}})[0]
    assert compiled == pytest.approx(plain, rel=1e-4)


def _plan_losses(rank, world, tmp, plan):
    from torch.distributed.fsdp import FSDPModule

    from titan_te.models import MODELS, blocks
    from titan_te.trainer import Trainer

    if plan == "blocks":  # this process only: the older plan, every block a unit and the rest with the root
        MODELS.get("llama3").fsdp_units = blocks
    with Trainer(make_cfg(tmp, world=world, training={"steps": 4, "deterministic": True})) as tr:
        m = tr.model
        units = {name: isinstance(getattr(m, name), FSDPModule) for name in ("tok_embeddings", "norm", "output")}
        shared = units["norm"] and m.norm._get_fsdp_state() is m.output._get_fsdp_state()
        return tr.train(), units, shared


def test_llama_wrap_plan_makes_embedding_and_head_units_and_keeps_the_losses(tmp_path):
    """Llama's FSDP plan (embedding, blocks, [norm, output]) on 2 gloo ranks: the embedding and the
    norm + output pair are units of their own, and the losses are those of the blocks-only plan."""
    (losses, units, shared), _ = run_ranks(_plan_losses, 2, str(tmp_path / "model"), "model")
    (old, old_units, _), _ = run_ranks(_plan_losses, 2, str(tmp_path / "blocks"), "blocks")
    assert units == {"tok_embeddings": True, "norm": True, "output": True} and shared
    assert old_units == {"tok_embeddings": False, "norm": False, "output": False}
    assert losses == pytest.approx(old, rel=1e-6) and len(losses) == 4
