"""Transformer Engine backend on a CUDA GPU (run on the H200 with -m gpu)."""
import pytest
import torch

from helpers import make_cfg, run_ranks

pytestmark = pytest.mark.gpu


def _te_and_torch_models():
    from titan_te.init_weights import init_weights
    from titan_te.layers.te_block import te_block, te_materialize
    from titan_te.layers.torch_block import TorchBlock
    from titan_te.models.llama import Llama, resolve_args

    args = resolve_args("debug", 320, 128, n_layers=2)
    dev = torch.device("cuda")
    ref = Llama(args, TorchBlock).to(dev)
    init_weights(ref, ref.init_rule, 0, dev)
    with torch.device("meta"):
        te_model = Llama(args, lambda a, i: te_block(a, i, params_dtype=torch.float32))
    te_materialize(te_model, dev)
    te_model.init_buffers(dev)
    missing, unexpected = te_model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return ref, te_model


def test_te_and_torch_backends_agree_in_bf16():
    ref, te_model = _te_and_torch_models()
    x = torch.randint(0, 258, (2, 128), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = ref(x), te_model(x)
    rel = ((a - b).norm() / a.norm()).item()
    print(f"te vs torch forward relative error {rel:.2e}")
    assert rel < 1e-2


def _train(rank, world, tmp, overrides):
    from titan_te.trainer import Trainer

    sections = {"training": {"steps": 30, "local_batch_size": 4, "seq_len": 128},
                "model": {"backend": "te"}, "metrics": {"log_freq": 10, "enable_tensorboard": False}}
    for key, value in overrides.items():
        sec, k = key.split(".")
        sections.setdefault(sec, {})[k] = value
    tr = Trainer(make_cfg(tmp, world=world, **sections))
    losses = tr.train()
    tr.close()
    return losses


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_recipes_train(recipe, tmp_path):
    losses = run_ranks(_train, 1, str(tmp_path), {"fp8.enable": True, "fp8.recipe": recipe})[0]
    print(recipe, losses[0], losses[-1])
    assert losses[-1] < 0.7 * losses[0]


def test_fp8_weights_with_te_fused_adam_masters_train(tmp_path):
    losses = run_ranks(_train, 1, str(tmp_path), {"fp8.enable": True, "fp8.params": True,
                                                  "optimizer.name": "te_fused_adam"})[0]
    print("fp8 params", losses[0], losses[-1])
    assert losses[-1] < 0.7 * losses[0]
