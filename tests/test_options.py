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


def _lion(rank, world, tmp, steps, momentum_dtype):
    from titan_te.trainer import Trainer

    cfg = make_cfg(tmp, world=world, job={"custom_import": "lion_opt"},
                   optimizer={"name": "lion", "lr": 1e-3, "weight_decay": 0.1,
                              "lion": {"momentum_dtype": momentum_dtype}},  # TOML's [optimizer.lion]
                   training={"steps": steps, "deterministic": True}, checkpoint={"enable": True, "interval": 2})
    with Trainer(cfg) as tr:
        start, losses = tr.state.step, tr.train()
        state = next(iter(tr.optimizer.state.values()))
        return start, losses, str(state["exp_avg"].dtype)


def test_a_second_optimizer_from_one_file_validates_shows_and_records_its_options(tmp_path):
    """tests/lion_opt.py alone: its [optimizer.lion] options typed, bounded and checked, listed in --help
    as its own, Adam's options refused for it, its state's dtype a checkpoint fact that a resume checks."""
    import re

    from titan_te import config as C
    from titan_te.checkpoint.folder import Manifest

    cfg, _ = C.load(["--job.custom_import=lion_opt", "--optimizer.name=lion", "--optimizer.lion.beta1=0.95"])
    assert C.component_options(cfg, "optimizer", "lion").beta1 == 0.95
    assert "--optimizer.lion.beta2 (float, default 0.99; with optimizer lion)" in C.help_text()
    for argv, message in [(["--optimizer.lion.beta1=1.5"], "optimizer.lion.beta1 must be within [0, 1)"),
                          (["--optimizer.lion.beta1=0.99", "--optimizer.lion.beta2=0.9"],
                           "[optimizer.lion]: beta2 (0.9) below beta1 (0.99) is not Lion"),
                          (["--optimizer.lion.momentum_dtype=fp8"],
                           "optimizer.lion.momentum_dtype = 'fp8' is not one of float32, bfloat16"),
                          (["--optimizer.beta1=0.8"], "optimizer.beta1 is not an option of lion, which reads "
                                                      "optimizer.lr, optimizer.weight_decay; its own options: "
                                                      "[optimizer.lion]")]:
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            C.load(["--job.custom_import=lion_opt", "--optimizer.name=lion", *argv])
    ref = run_ranks(_lion, 1, str(tmp_path / "ref"), 4, "bfloat16")[0]
    assert ref[1][-1] < ref[1][0] and ref[2] == "torch.bfloat16"
    run_ranks(_lion, 1, str(tmp_path / "run"), 2, "bfloat16")
    facts = Manifest.read(tmp_path / "run/t/checkpoint/step-2").facts["optimizer"]
    assert facts == {"name": "lion", "lion.momentum_dtype": "bfloat16"}
    with pytest.raises(AssertionError, match=re.escape("optimizer.lion.momentum_dtype is 'bfloat16' in the checkpoint, "
                                                       "'float32' in this run")):
        run_ranks(_lion, 1, str(tmp_path / "run"), 4, "float32")
    start, losses, _ = run_ranks(_lion, 1, str(tmp_path / "run"), 4, "bfloat16")[0]
    assert start == 2 and losses == pytest.approx(ref[1][2:], rel=1e-6)
