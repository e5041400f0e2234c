"""Real 2-rank gloo runs: FSDP2 / HSDP / DDP match one process with gradient accumulation."""
import pytest
import torch
from torch.distributed.tensor import DTensor

from helpers import make_cfg, run_ranks

STEPS = 5


def train_losses(rank, world, tmp, dp, local_bs, global_bs):
    from titan_te.trainer import Trainer

    cfg = make_cfg(tmp, world=world, training={"steps": STEPS, "local_batch_size": local_bs,
                                               "global_batch_size": global_bs, "seq_len": 32},
                   parallelism={"data_parallel": dp, "data_parallel_replicate_degree": 2 if dp == "hsdp" else 1})
    tr = Trainer(cfg)
    losses = tr.train()
    tr.close()
    return losses


def full_weights(rank, world, tmp):
    from titan_te.trainer import Trainer

    tr = Trainer(make_cfg(tmp, world=world))
    out = {}
    for name, p in tr.model.named_parameters():
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    tr.close()
    return out


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    # One process, micro-batch 2, global batch 4: two micro-batches of accumulation per step.
    return run_ranks(train_losses, 1, str(tmp_path_factory.mktemp("one")), "fsdp", 2, 4)[0]


@pytest.mark.parametrize("dp, local_bs", [("fsdp", 2), ("hsdp", 2), ("ddp", 2), ("fsdp", 1), ("ddp", 1)],
                         ids=["fsdp", "hsdp", "ddp", "fsdp-accumulating", "ddp-accumulating"])
def test_two_ranks_match_one_process_with_accumulation(dp, local_bs, tmp_path, single_process_losses):
    """The same global batch of 4: on 2 ranks as one micro-batch of 2 each, or two micro-batches of 1 each. DDP
    reduced param.grad after every micro-batch, so the next reduction summed the earlier micro-batches' reduced
    gradients again from every rank (world size times too much of them): losses off from the second step, until
    every micro-batch but the last ran in DDP's no_sync."""
    ranks = run_ranks(train_losses, 2, str(tmp_path), dp, local_bs, 4)
    assert len(single_process_losses) == STEPS
    assert ranks[0] == ranks[1]  # every rank reports the global loss
    for a, b in zip(ranks[0], single_process_losses):
        assert abs(a - b) < 1e-5, (ranks[0], single_process_losses)
    assert single_process_losses[-1] < single_process_losses[0]


def _warnings_of_a_ddp_trainer(rank, world, tmp):
    import warnings

    from titan_te.trainer import Trainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = Trainer(make_cfg(tmp, world=world, parallelism={"data_parallel": "ddp"}))
        tr.train(until_step=1)
    tr.close()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_ddp_prints_no_deprecation_warning(tmp_path):
    """torch 2.13 deprecated DDP's `broadcast_buffers` with a FutureWarning that every DDP run printed."""
    for caught in run_ranks(_warnings_of_a_ddp_trainer, 2, str(tmp_path)):
        assert not [w for w in caught if "deprecated" in w], caught


def test_initial_full_weights_identical_for_world_sizes_1_and_2(tmp_path):
    one = run_ranks(full_weights, 1, str(tmp_path / "a"))[0]
    two = run_ranks(full_weights, 2, str(tmp_path / "b"))
    assert one.keys() == two[0].keys()
    for name in one:
        assert torch.equal(one[name], two[0][name]), name
        assert torch.equal(two[0][name], two[1][name]), name
    # shards are not repetitions of one block (the reset_parameters trap)
    w = one["layers.0.layernorm_mlp.fc1_weight"]
    half = w.shape[0] // 2
    assert not torch.equal(w[:half], w[half:])


def _mesh_places(rank, world):
    from helpers import make_cfg
    from titan_te.parallel.dims import ParallelDims
    from titan_te.parallel.dist import init_distributed

    cfg = make_cfg("/tmp", world=world, parallelism={"data_parallel": "hsdp", "data_parallel_replicate_degree": 2})
    dims = ParallelDims.from_config(cfg.parallelism, world)
    env = init_distributed("cpu", dims)
    return ({n: env.mesh.get_local_rank(n) for n in dims.names}, dims.coordinates(rank), env.dp_rank, env.dp_world)


def test_the_parallel_dims_place_every_rank_where_the_mesh_does():
    """HSDP 2 x 2 on 4 gloo ranks: each rank's coordinates and data-parallel rank come from the one object that
    built the mesh, and agree with the mesh itself."""
    got = run_ranks(_mesh_places, 4)
    assert [mesh for mesh, _, _, _ in got] == [coords for _, coords, _, _ in got]
    assert [dp for _, _, dp, _ in got] == [0, 1, 2, 3] and {w for *_, w in got} == {4}


def test_weights_that_gather_themselves_need_rows_that_divide_by_the_shard_count():
    """TE's FP8 weights hand FSDP2 their shard unpadded; FSDP2 then fails on the short ranks only (the others
    wait), so an uneven split is refused before any collective. Plain weights are padded by FSDP2: allowed."""
    from titan_te.errors import ConfigError
    from titan_te.parallel.data_parallel import check_even_shards

    class GathersItself(torch.Tensor):
        def fsdp_pre_all_gather(self, *args):
            raise AssertionError("not called by the check")

    model = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Linear(9, 10))
    check_even_shards(model, 3)  # plain weights of 9 and 10 rows
    model[1].weight = torch.nn.Parameter(torch.empty(10, 9).as_subclass(GathersItself))
    check_even_shards(model, 2)
    with pytest.raises(ConfigError, match=r"^1.weight is an FP8 weight of 10 rows, which 3 FSDP shards do not "
                                          r"divide evenly .*--fp8.params=false$"):
        check_even_shards(model, 3)


def _init_targets(rank, world, tmp):
    from titan_te.init_weights import init_weights
    from titan_te.trainer import Trainer

    tr = Trainer(make_cfg(tmp, world=world))
    seen = []
    init_weights(tr.model, tr.model.init_rule, 0, tr.device, write=lambda target, value: seen.append(target))
    owners = {id(p._local_tensor) for p in tr.model.parameters() if isinstance(p, DTensor)}
    tr.close()
    return len(seen), sum(id(t) in owners for t in seen), len(owners)


def test_init_writes_into_the_shards_the_optimizer_holds():
    """init's write receives each DTensor's own local tensor, not to_local()'s fresh view (newer torch returns
    one for a Parameter): an FP8 weight's scale and the values fused_adam seeds its masters from
    (FP8Policy.init_value) are then those of the object the optimizer steps."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        written, into_shards, shards = run_ranks(_init_targets, 2, tmp)[0]
    assert shards > 0 and written == into_shards == shards


def test_the_shared_gpu_mode_on_the_cpu_says_it_has_no_effect(tmp_path, monkeypatch, caplog):
    import logging

    from titan_te.trainer import Trainer

    monkeypatch.setenv("TITAN_TE_SHARE_GPU", "1")
    with caplog.at_level(logging.INFO, logger="titan_te"), Trainer(make_cfg(tmp_path, training={"steps": 1})) as tr:
        tr.train()
    assert "parallel: fsdp on 1 rank(s) (dp_replicate 1 x dp_shard 1), device cpu; TITAN_TE_SHARE_GPU=1 has no " \
           "effect here (it puts the ranks of a GPU run on one GPU)" in caplog.text


def validation_loss(rank, world, tmp, local_bs):
    from titan_te.trainer import Trainer

    cfg = make_cfg(tmp, world=world, training={"steps": 2, "local_batch_size": local_bs, "global_batch_size": 4,
                                               "seq_len": 32},
                   validation={"enable": True, "freq": 2, "steps": 3})
    tr = Trainer(cfg)
    tr.train()
    loss = tr.validator.run(tr.train_model, tr.loss_sum)
    tr.close()
    return loss


def test_the_validation_loss_is_the_same_on_any_number_of_ranks(tmp_path):
    """validation.steps counts global batches, dealt to the ranks as training batches are: one rank, two ranks
    and two ranks with accumulation evaluate the same held-out sequences (it counted batches per rank, so the
    validation curve of a run resumed on other GPUs jumped: 4.34, 4.46 and 4.20 on 1, 2 and 4 ranks)."""
    one = run_ranks(validation_loss, 1, str(tmp_path / "one"), 2)[0]
    two = run_ranks(validation_loss, 2, str(tmp_path / "two"), 2)
    accumulating = run_ranks(validation_loss, 2, str(tmp_path / "acc"), 1)
    assert two[0] == two[1] and accumulating[0] == accumulating[1]
    assert two[0] == pytest.approx(one, rel=1e-6) and accumulating[0] == pytest.approx(one, rel=1e-6), (one, two,
                                                                                                       accumulating)
