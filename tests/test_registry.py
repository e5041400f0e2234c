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


def test_all_component_registries_are_populated():
    from titan_te.data import DATASETS, TOKENIZERS
    from titan_te.layers import BACKENDS
    from titan_te.models import MODELS
    from titan_te.optim import LR_DECAYS, OPTIMIZERS
    from titan_te.parallel import PARALLELISMS

    assert "llama3" in MODELS and {"torch", "te"} <= set(BACKENDS)
    assert {"fsdp", "hsdp", "ddp", "none"} <= set(PARALLELISMS)
    assert "adamw" in OPTIMIZERS and {"cosine", "linear", "constant"} <= set(LR_DECAYS)
    assert "embedded" in DATASETS and "byte" in TOKENIZERS
