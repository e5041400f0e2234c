import pytest

from titan_te.registry import Registry, RegistryError


def test_register_and_get():
    reg = Registry("widget")
    reg.register("a")(1)
    reg.register("b")(2)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg


def test_miss_lists_valid_names_and_suggests():
    reg = Registry("widget")
    reg.register("adamw")(1)
    reg.register("fused_adam")(2)
    with pytest.raises(RegistryError) as e:
        reg.get("adamww")
    msg = str(e.value)
    assert "unknown widget 'adamww'" in msg and "did you mean 'adamw'" in msg and "fused_adam" in msg


def test_double_registration_is_refused():
    reg = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(2)


def test_every_registry_entry_answers_for_its_name_and_capabilities():
    from titan_te.te.recipes import RECIPES
    from titan_te.layers import BACKENDS
    from titan_te.models import MODELS
    from titan_te.optim import LR_DECAYS, OPTIMIZERS
    from titan_te.parallel import PARALLELISMS

    for reg in (MODELS, BACKENDS, PARALLELISMS, OPTIMIZERS, RECIPES):
        assert reg.names() and all(reg.get(n).name == n for n in reg.names()), reg.kind
    assert {n: (s.multi_process, s.replicates, s.reduces_grads_itself, s.shards_params) for n, s in
            ((n, PARALLELISMS.get(n)) for n in PARALLELISMS.names())} == {
        "ddp": (True, False, False, False), "fsdp": (True, False, True, True), "hsdp": (True, True, True, True),
        "none": (False, False, False, False)}
    te, torch_ = BACKENDS.get("te"), BACKENDS.get("torch")
    assert (te.needs_cuda, te.fp8, te.compiles_blocks, te.recomputes_mlp) == (True, True, False, True)
    assert "transformer_engine" in te.install
    assert (torch_.needs_cuda, torch_.fp8, torch_.available(), torch_.recomputes_mlp) == (False, False, "", False)
    assert [RECIPES.get(n).min_compute_capability for n in ("delayed", "block", "mxfp8")] == [(8, 9), (9, 0), (10, 0)]
    low = type("O", (), {"moment_dtype": "bfloat16", "master_weights": True})()
    assert OPTIMIZERS.get("fused_adam").state_bytes(low, True) == 8 and OPTIMIZERS.get("adamw").state_bytes(low, True) == 8
    assert [LR_DECAYS.get(n)(0.5) for n in ("cosine", "linear", "constant")] == [0.5, 0.5, 1.0]
    args = MODELS.get("llama3").args_for("debug", 320, 64, 2)
    assert (args.vocab_size, args.n_layers) == (320, 2)
