import dataclasses
import re
import subprocess
import sys
import tomllib

import pytest

from titan_te import config as C

from conftest import ROOT


def train(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_then_toml_then_cli(tmp_path):
    f = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg, _ = C.load(["--config", f, "--training.steps=9", "--optimizer.lr", "0.25"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64 and cfg.optimizer.lr == 0.25
    assert cfg.training.local_batch_size == C.Training().local_batch_size  # default kept


def test_override_types_bools_and_lists(tmp_path):
    cfg, _ = C.load(["--training.deterministic=true", "--data.shuffle", "false",
                     "--checkpoint.exclude_from_loading=dataloader,optimizer", "--metrics.enable_tensorboard"])
    assert cfg.training.deterministic is True and cfg.data.shuffle is False
    assert cfg.checkpoint.exclude_from_loading == ["dataloader", "optimizer"]
    assert cfg.metrics.enable_tensorboard is True


@pytest.mark.parametrize("argv, expected", [
    (["--trainng.steps=3"], "unknown section [trainng] (did you mean 'training'?)"),
    (["--training.stpes=3"], "unknown key training.stpes (did you mean '--training.steps'?)"),
    (["--training.steps=abc"], "training.steps expects int, got 'abc'"),
    (["--training.lr=1e-3"], "unknown key training.lr (did you mean '--optimizer.lr'? [training] has no 'lr')"),
    (["--training.steps"], "--training.steps needs a value, e.g. --training.steps=200"),
    (["--training.steps", "--training.seq_len=8"], "--training.steps needs a value"),
    # a component's option given alone said "expects float, got <object object at 0x...>"
    (["--optimizer.name=sgd", "--optimizer.sgd.momentum"],
     "--optimizer.sgd.momentum needs a value, e.g. --optimizer.sgd.momentum=0.0"),
    (["--optimizer.name=sgd", "--optimizer.sgd.nesterov", "--optimizer.sgd.momentum=0.9", "--optimizer.sgd.dampening"],
     "--optimizer.sgd.dampening needs a value"),  # the bool before it, alone, is true
    (["--data.shuffle=yes"], "data.shuffle expects true or false, got 'yes'"),
    (["--data.shuffle=1"], "data.shuffle expects true or false, got '1'"),
    (["--training.steps=-1"], "training.steps must be within [1, 1,000,000,000], got -1"),
    (["--training.deterministic=maybe"], "training.deterministic expects true or false"),
    (["--optimizer.name=adamx"], "optimizer.name: unknown optimizer 'adamx' (did you mean 'adamw'?)"),
    (["--model.flavor=9B"], "model.flavor = '9B' is not a flavor of llama3"),
    (["--parallelism.data_parallel=zero3"], "unknown data parallelism 'zero3'"),
    (["--training.local_batch_size=3", "--training.global_batch_size=8"], "is not divisible by local_batch_size"),
    (["--checkpoint.async_mode=sometimes"], "checkpoint.async_mode = 'sometimes' is not one of"),
    (["--checkpoint.exclude_from_loading=dataloder"], "did you mean 'dataloader'"),
    (["--parallelism.data_parallel_replicate_degree=2"], "is not divisible by parallelism.data_parallel_replicate_degree"),
    (["--parallelism.data_parallel_shard_degree=2"], "replicate x shard degree = 1 x 2 must equal the world size 1"),
    # a script's unset variable (--job.dump_folder=$DIR): never the current directory or the run folder's top
    (["--job.dump_folder="], "job.dump_folder is empty; it names a folder (default './outputs')"),
    (["--checkpoint.folder="], "checkpoint.folder is empty; it names a folder (default 'checkpoint')"),
])
def test_errors_name_the_key(argv, expected):
    with pytest.raises(C.ConfigError) as e:
        C.load(argv)
    assert expected in str(e.value)


def test_toml_type_error_names_file(tmp_path):
    f = write(tmp_path, "[training]\nsteps = \"ten\"\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(["--config", f])
    assert "training.steps expects int" in str(e.value) and f in str(e.value)


def test_cli_exit_code_2_and_no_traceback(tmp_path):
    bad = write(tmp_path, "[training\nsteps = 3\n")
    for args, needle in [(["--config", bad], "TOML syntax error in"),
                         (["--config", str(tmp_path / "missing.toml")], "config file not found"),
                         (["--training.stepz=3"], "did you mean '--training.steps'"),
                         (["--model.backend=te"], "use --model.backend=torch"),
                         (["--fp8.enable=true"], "fp8.enable")]:
        r = train(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("config error:") and needle in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help_lists_every_option():
    r = train("--help")
    assert r.returncode == 0
    for section, cls in C.sections().items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} (" in r.stdout
    assert "--training.steps (int, default 200)" in r.stdout
    assert "gradient accumulation" in r.stdout  # docs are shown


def test_print_config_is_parseable_toml_and_roundtrips(tmp_path):
    r = train("--config", str(ROOT / "train_configs/debug.toml"), "--training.steps=11", "--print-config")
    assert r.returncode == 0, r.stderr
    parsed = tomllib.loads(r.stdout)
    assert parsed["training"]["steps"] == 11 and parsed["model"]["flavor"] == "debug"
    again = C.build(parsed, [])
    assert C.to_toml(again) == r.stdout


def test_custom_import_registers_a_dataset(tmp_path, monkeypatch):
    (tmp_path / "my_data.py").write_text(
        "from titan_te.data import DATASETS\n"
        "from titan_te.data.token_source import ArrayTokenSource\n"
        "import numpy as np\n"
        "@DATASETS.register('counting')\n"
        "def build(dcfg, tok):\n"
        "    return ArrayTokenSource(np.arange(10000) % 200, 'counting')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, _ = C.load(["--job.custom_import=my_data", "--data.dataset=counting"])
    assert cfg.data.dataset == "counting"
    with pytest.raises(C.ConfigError, match="cannot import 'no_such_mod'"):
        C.load(["--job.custom_import=no_such_mod"])


def test_help_with_a_config_file_shows_its_values_beside_the_defaults(capsys):
    from titan_te.main import main

    assert main(["--config", "llama3_1b_fp8", "--help"]) == 0
    out = capsys.readouterr().out
    assert '--model.flavor (str, default "debug", llama3_1b_fp8: "1B")' in out
    assert "--training.steps (int, default 200, llama3_1b_fp8: 1000)" in out
    assert "--training.seed (int, default 0)\n" in out  # the same as the default: shown once


def test_help_lists_the_registered_names(capsys):
    from titan_te.main import main

    assert main(["--help"]) == 0
    listed = [line.split("registered: ", 1)[1].split(", ") for line in capsys.readouterr().out.splitlines()
              if "registered: " in line]
    # each list sorted; an earlier test in the same process may have registered more (test_options' lion)
    assert all(names == sorted(names) for names in listed)
    for names in (["block", "current", "delayed", "mxfp8", "nvfp4"], ["ddp", "fsdp", "hsdp", "none"],
                  ["adamw", "fused_adam", "sgd", "te_fused_adam"]):
        assert any(set(names) <= set(got) for got in listed), names


def test_a_component_declares_its_own_options_section(tmp_path):
    """[optimizer.sgd] holds SGD's own options (momentum does not borrow optimizer.beta1): TOML and CLI,
    typed and bounded, listed in --help, written back by --print-config."""
    toml = tmp_path / "sgd.toml"
    toml.write_text('[optimizer]\nname = "sgd"\n\n[optimizer.sgd]\nmomentum = 0.5\nnesterov = true\n')
    cfg, _ = C.load(["--config", str(toml), "--optimizer.sgd.momentum=0.9"])
    opts = C.component_options(cfg, "optimizer", "sgd")
    assert (opts.momentum, opts.dampening, opts.nesterov) == (0.9, 0.0, True)  # CLI > TOML > defaults
    again = C.build(tomllib.loads(C.to_toml(cfg)), [])
    assert C.component_options(again, "optimizer", "sgd") == opts
    assert "--optimizer.sgd.momentum (float, default 0.0; with optimizer sgd)" in C.help_text()
    for argv, message in [
        (["--optimizer.sgd.momentun=0.9"], "unknown key optimizer.sgd.momentun (did you mean 'momentum'?)"),
        (["--optimizer.sgd.momentum=1.5"], "optimizer.sgd.momentum must be within [0, 1)"),
        (["--optimizer.sgd.momentum=fast"], "optimizer.sgd.momentum expects float, got 'fast'"),
        (["--optimizer.sgd.nesterov=true"], "[optimizer.sgd]: nesterov = true needs momentum > 0"),
        (["--optimizer.sdg.momentum=0.9"], "[optimizer.sdg]: no registered component of [optimizer] is named 'sdg' "
                                           "(did you mean 'sgd'?)"),
        (["--optimizer.adamw.momentum=0.9"], "[optimizer.adamw]: adamw declares no options of its own"),
        (["--optimizer.sgd.momentum.x=1"], "a component's option is optimizer.<component>.<key>"),
    ]:
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            C.load(argv)


def _sgd_run(rank, world, tmp, momentum):
    from helpers import make_cfg
    from titan_te.trainer import Trainer

    cfg = make_cfg(tmp, optimizer={"name": "sgd", "lr": 0.05}, training={"steps": 4, "deterministic": True})
    cfg.components["optimizer.sgd"] = {"momentum": (momentum, "<test>")}
    with Trainer(cfg) as tr:
        return tr.optimizer.param_groups[0]["momentum"], tr.train()


def test_the_optimizer_receives_its_own_options(tmp_path):
    from helpers import run_ranks

    (m0, plain), (m9, heavy) = (run_ranks(_sgd_run, 1, str(tmp_path / str(m)), m)[0] for m in (0.0, 0.9))
    assert (m0, m9) == (0.0, 0.9)
    assert plain[0] == heavy[0] and plain[1] == heavy[1]  # momentum acts from the second update on
    assert plain[3] != pytest.approx(heavy[3], rel=1e-4)


def test_an_option_the_chosen_optimizer_does_not_read_is_refused_and_help_says_who_reads_it(capsys):
    from titan_te.main import main

    capsys.readouterr()
    assert main(["--optimizer.name=sgd", "--optimizer.beta1=0.8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: optimizer.beta1 is not an option of sgd, which reads optimizer.lr, "
                          "optimizer.weight_decay; its own options: [optimizer.sgd]"), err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--optimizer.moment_dtype (str" in out and "read by: fused_adam, te_fused_adam" in out
    assert "--optimizer.beta1 (float" in out and "read by: adamw, fused_adam, te_fused_adam" in out


def test_an_option_the_chosen_dataset_tokenizer_or_recipe_ignores_is_refused_unless_a_file_set_it_for_its_choice(
        tmp_path, capsys):
    """data.path with the embedded dataset trained on the embedded corpus without a word. Such an option is
    refused on the command line and in a file; a file's option stays when the command line picks another
    component, and a file that sets every option to its default (--print-config, the run folder's config.toml)
    loads."""
    with pytest.raises(C.ConfigError, match=re.escape("data.path is not an option of embedded")):
        C.load(["--data.path=/data/shards"], hardware=False)
    preset = tmp_path / "shards.toml"
    preset.write_text('[data]\ndataset = "tokens"\npath = "/data/shards"\n\n[fp8]\nmargin = 1\n')
    cfg, _ = C.load(["--config", str(preset), "--data.dataset=embedded", "--fp8.recipe=current"], hardware=False)
    assert (cfg.data.dataset, cfg.data.path, cfg.fp8.margin) == ("embedded", "/data/shards", 1)
    with pytest.raises(C.ConfigError, match=re.escape("fp8.margin is not an option of current, which reads none of the "
                                                      "options that depend on fp8.recipe; fp8.margin is for delayed")):
        C.load(["--config", str(preset), "--fp8.recipe=current", "--fp8.margin=2"], hardware=False)
    for name in ("debug", "llama_fp8"):
        printed = tmp_path / f"{name}.toml"
        printed.write_text(C.to_toml(C.load(["--config", name], hardware=False)[0]))
        again, _ = C.load(["--config", str(printed), "--fp8.recipe=current", "--optimizer.name=sgd"], hardware=False)
        assert again.optimizer.name == "sgd" and again.data.tokenizer_path == ""
    from titan_te.main import main

    capsys.readouterr()
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for option, readers, not_readers in [("data.path", {"files", "hf", "tokens"}, {"embedded"}),
                                         ("data.text_field", {"files", "hf"}, {"embedded", "tokens"}),
                                         ("data.tokenizer_path", {"hf", "tiktoken"}, {"byte"}),
                                         ("fp8.margin", {"delayed"}, {"current", "block"}),
                                         ("fp8.fused_swiglu", {"delayed"}, {"current", "block"})]:
        # (a component that another test registered without saying what it reads reads everything)
        listed = set(re.search(rf"--{re.escape(option)} \(.*\n.*\n +read by: (.*)\n", out).group(1).split(", "))
        assert readers <= listed and not not_readers & listed, (option, listed)
    assert "--data.num_workers (int, default 0)\n      data-loader worker processes\n  --" in out  # every dataset


def test_fp8_enable_false_alone_turns_an_fp8_presets_refinements_off(tmp_path):
    """The FP8 presets' refinements of FP8 (fp8.params, head, fused_swiglu) are for their own FP8: --fp8.enable=false
    alone loads them without FP8, the refinements back at their defaults (what --print-config shows); one typed
    with it, or one a file sets without FP8, is refused."""
    for preset in ("llama3_1b_fp8", "llama_fp8"):
        cfg, _ = C.load(["--config", preset, "--fp8.enable=false"], hardware=False)
        assert (cfg.fp8.enable, cfg.fp8.params, cfg.fp8.head, cfg.fp8.fused_swiglu) == (False, False, "off", False)
        assert 'head = "off"' in C.to_toml(cfg) and "fp8.head" not in cfg.origins
        on, _ = C.load(["--config", preset], hardware=False)
        assert (on.fp8.enable, on.fp8.params, on.fp8.fused_swiglu) == (True, True, True)
    mixed = tmp_path / "mixed.toml"
    mixed.write_text("[fp8]\nenable = false\nfused_swiglu = true\n")
    for argv in (["--config", str(mixed)],
                 ["--config", "llama3_1b_fp8", "--fp8.enable=false", "--fp8.fused_swiglu=true"]):
        with pytest.raises(C.ConfigError, match="fp8.fused_swiglu = true needs fp8.enable = true; set "
                                                "--fp8.enable=true, or --fp8.fused_swiglu=false"):
            C.load(argv, hardware=False)
    with pytest.raises(C.ConfigError, match="fp8.head = 'all' needs fp8.enable = true"):
        C.load(["--config", "llama3_1b_fp8", "--fp8.enable=false", "--fp8.head=all"], hardware=False)


def test_a_model_familys_own_rules_run_with_the_config(capsys):
    """Llama's rule (FP8 attention needs head_dim 128) is on its spec and runs before anything is built."""
    from titan_te.main import main

    capsys.readouterr()
    assert main(["--fp8.enable=true", "--fp8.attention=true"]) == 2
    assert "the debug flavor's is 32; set --fp8.attention=false" in capsys.readouterr().err


def test_bf16_weight_gradients_need_them_in_place_and_an_optimizer_that_reads_them(capsys):
    from titan_te.main import main

    capsys.readouterr()
    assert main(["--model.wgrad_dtype=bfloat16", "--optimizer.name=adamw"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: model.wgrad_dtype = 'bfloat16': optimizer adamw does not read bf16 gradients of FP32 weights; "
        "optimizers that do: fused_adam (in <defaults> or the command line)"]
    assert main(["--model.wgrad_dtype=bfloat16", "--optimizer.name=fused_adam",
                 "--model.fuse_wgrad_accumulation=false"]) == 2
    assert capsys.readouterr().err.startswith(
        "config error: model.wgrad_dtype = 'bfloat16' is the dtype of TE's in-place weight gradients, which "
        "model.fuse_wgrad_accumulation = false turns off")
