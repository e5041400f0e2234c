"""Hugging Face export/import: a DCP checkpoint -> safetensors folder -> a new run, same loss."""
import json

import pytest
import torch

from helpers import make_cfg, run_ranks


def _train(rank, world, tmp, steps, checkpoint, extra):
    from titan_te.trainer import Trainer

    sections = {"training": {"steps": steps, "local_batch_size": 2, "seq_len": 32, "deterministic": True},
                "checkpoint": checkpoint}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    tr = Trainer(make_cfg(tmp, world=world, **sections))
    losses = tr.train()
    tr.close()
    return losses


@pytest.mark.parametrize("world", [1, 2])
def test_export_then_import_keeps_the_first_step_loss(tmp_path, world):
    from titan_te import export

    run = tmp_path / "run"
    run_ranks(_train, world, run, 3, {"enable": True, "interval": 100}, {})
    ckpt = run / "t" / "checkpoint" / "step-3"
    hf = tmp_path / "hf"
    assert export.main(["--checkpoint", str(ckpt), "--out", str(hf), "--dtype", "float32"]) == 0
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 4 and cfg["rope_theta"] == 10000.0
    # The checkpointed model takes step 4 on the data the fresh run will see first (data order restarts).
    resumed = run_ranks(_train, world, run, 4, {"enable": True, "interval": 100,
                                                "exclude_from_loading": "dataloader,optimizer,lr_scheduler,rng"},
                        {})[0]
    fresh = run_ranks(_train, world, tmp_path / "fresh", 1, {"enable": False, "initial_load_path": str(hf)}, {})[0]
    assert len(resumed) == 1 and len(fresh) == 1
    assert fresh[0] == resumed[0]


def test_export_shards_large_models_and_writes_the_chosen_dtype(tmp_path):
    from safetensors.torch import load_file

    from titan_te.hf_files import read_hf_folder, save_hf_folder

    tensors = {f"t{i}": torch.full((256, 256), float(i)) for i in range(4)}  # 128 KiB each in bf16: two per shard
    save_hf_folder({k: v.bfloat16() for k, v in tensors.items()}, {"x": 1}, tmp_path, shard_bytes=300_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert load_file(str(tmp_path / index["weight_map"]["t2"]))["t2"].dtype == torch.bfloat16
    back = read_hf_folder(tmp_path)
    assert all(torch.equal(back[k].float(), tensors[k]) for k in tensors)


def test_initial_load_path_that_is_not_a_model_folder_is_a_config_error(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(AssertionError, match="initial_load_path.*not a Llama safetensors folder"):
        run_ranks(_train, 1, tmp_path / "run", 1, {"enable": False, "initial_load_path": str(tmp_path / "hf")}, {})


def test_export_of_an_incomplete_checkpoint_is_refused(tmp_path, capsys):
    from titan_te import export

    (tmp_path / "step-5.tmp").mkdir()
    assert export.main(["--checkpoint", str(tmp_path / "step-5.tmp"), "--out", str(tmp_path / "o")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err


def test_initial_load_path_with_more_layers_than_the_model_is_refused(tmp_path):
    from titan_te import export

    run_ranks(_train, 1, tmp_path / "run", 1, {"enable": True, "interval": 100}, {})
    hf = tmp_path / "hf"
    assert export.main(["--checkpoint", str(tmp_path / "run/t/checkpoint/step-1"), "--out", str(hf)]) == 0
    with pytest.raises(AssertionError) as e:
        run_ranks(_train, 1, tmp_path / "small", 1, {"enable": False, "initial_load_path": str(hf)},
                  {"model": {"n_layers": 2}})
    msg = str(e.value)
    assert "ConfigError" in msg and "model.layers.2." in msg and "it has 4 layers, the model 2" in msg
