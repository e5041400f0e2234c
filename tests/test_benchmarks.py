"""The benchmark's own arithmetic (the GPU runs themselves are benchmarks, not tests)."""
import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import train_bench  # noqa: E402


def test_breakdown_counts_the_steady_steps_queued_work_by_category_and_idle_once(tmp_path):
    """Two counted steps (host ranges 0-100 and 100-200) and the closing one (200-300, left out). GPU work is
    assigned to the step that queued it (correlation ids); work queued before the first range (the loop's
    start) or in the closing step is not counted, nor is the time around the counted window."""
    host = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 100 * i, "dur": 100}
            for i in range(3)]
    host += [{**r, "cat": "gpu_user_annotation", "ts": r["ts"] + 1000} for r in host]  # kineto's GPU-row copies
    queued_at = {1: 5, 2: 10, 3: 20, 4: 30, 5: 120, 6: 130, 7: 140, 8: 150, 9: 210, 10: -50}
    launches = [{"ph": "X", "cat": "cuda_runtime" if c % 2 else "cuda_driver", "name": "cudaLaunchKernel", "ts": t,
                 "dur": 2, "args": {"correlation": c}} for c, t in queued_at.items()]

    def gpu(c, name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": c}}

    work = [  # µs on the GPU; two streams overlap between 1040 and 1050
        gpu(1, "nvjet_sm90_tst_128x256_TNT", 1000, 40),
        gpu(2, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1030, 20),
        gpu(3, "adam_fp8", 1060, 10),
        gpu(4, "Memcpy DtoD", 1070, 5, cat="gpu_memcpy"),
        gpu(5, "elementwise_kernel<gpu_kernel_impl_nocast<CUDAFunctor_add<float>>", 1075, 5),
        gpu(6, "cast_transpose_fusion_kernel_optimized", 1080, 10),
        gpu(7, "nvjet_sm90_tst_128x256_TNT", 1100, 40),
        gpu(8, "adam_fp8", 1150, 10),
        gpu(9, "nvjet_sm90_tst_128x256_TNT", 1160, 500),  # the closing step's
        gpu(10, "nvjet_sm90_tst_128x256_TNT", 900, 50),  # queued before the traced steps
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host events are not GPU time
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": host + launches + work}))
    parts = train_bench.breakdown(trace)
    assert parts["gemm"] == 0.04 and parts["attention"] == 0.01 and parts["optimizer"] == 0.01  # ms per step
    assert parts["copies/comm"] == 0.0025 and parts["other"] == 0.0025  # "nocast" is not a cast
    assert parts["cast/transpose"] == 0.005
    # window 1000-1160 (160 µs); busy 1000-1050, 1060-1090, 1100-1140, 1150-1160 (the overlap counted once)
    assert parts["traced_ms"] == 0.08 and parts["idle"] == (160 - 130) / 2 / 1e3
    assert parts["busy_pct"] == 100 * 130 / 160


def test_breakdown_of_a_trace_without_two_steps_says_so(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#0", "ts": 0, "dur": 1}]}))
    with pytest.raises(train_bench.NoBreakdown, match="fewer than two ProfilerStep ranges"):
        train_bench.breakdown(trace)


def test_train_bench_runs_a_preset_on_several_ranks_and_prints_the_scaling(tmp_path):
    """--ngpu N starts N ranks of the preset run (NCCL on GPUs; here gloo on the CPU, so only the mechanics
    are checked: every rank runs, rank 0 reports, tokens/s is per GPU, the JSON feeds the planner)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "bench.json"
    cpu = ["--model.backend=torch", "--fp8.enable=false",
           "--training.device=cpu", "--optimizer.name=adamw", "--training.local_batch_size=2"]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/train_bench.py"), "--runs", "1b_fp8", "--flavor", "debug",
                        "--n_layers", "1", "--seq_len", "64", "--warmup", "1", "--steps", "2", "--profile_steps", "1",
                        "--ngpu", "2", "--json", str(out), *[f"--override={o}" for o in cpu]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| run | 1 GPU | 2 GPUs | scaling efficiency |" in r.stdout
    runs = json.loads(out.read_text())
    assert runs["1b_fp8"]["gpus"] == 1 and runs["1b_fp8@2gpu"]["gpus"] == 2
    assert runs["1b_fp8@2gpu"]["tokens"] == 2 * runs["1b_fp8"]["tokens"]  # the preset's batch on every GPU


def test_every_benchmark_row_is_a_config_the_trainer_accepts():
    """Each preset row of train_bench and loss_bench, its preset with its overrides, passes the config's validation
    (all but the checks of this machine's GPU and packages): a refused row would otherwise show first on a GPU, as
    1b_fp8_full_logits did (model.fused_loss = false under the 1B preset's fp8.head = "all")."""
    import loss_bench
    from titan_te import config as config_mod

    rows = [(name, train_bench.PRESETS[size][0], overrides)
            for name, (kind, size, overrides) in train_bench.RUNS.items() if kind != "peer"]
    rows += [(name, preset, overrides) for name, overrides in loss_bench.RUNS.items()
             for size, preset in loss_bench.PRESETS.items() if size != "1b" or not name.startswith("fp8_attention")]
    assert len(rows) > 20
    for name, preset, overrides in rows:
        cfg, _ = config_mod.load(["--config", preset, *overrides], hardware=False)
        assert cfg.model.backend == "te", name
    with pytest.raises(config_mod.ConfigError, match="FP8 attention takes head_dim 128 only"):  # the 1B's is 64
        config_mod.load(["--config", "llama3_1b_fp8", *loss_bench.RUNS["fp8_attention"]], hardware=False)
    cfg, _ = config_mod.load(["--config", "llama3_1b_fp8", *train_bench.RUNS["1b_fp8_full_logits"][2]], hardware=False)
    assert (cfg.model.fused_loss, cfg.fp8.head) == (False, "off")
    cfg, _ = config_mod.load(["--config", "llama_fp8", *train_bench.RUNS["8b_fp8_b2_every8"][2]], hardware=False)
    assert (cfg.training.local_batch_size, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.every_n) == (
        2, "every_n", 8)
    preset_8b = config_mod.load(["--config", "llama_fp8"], hardware=False)[0]
    assert (preset_8b.training.local_batch_size, preset_8b.activation_checkpoint.mode) == (2, "auto")
    cfg, _ = config_mod.load(["--config", "llama_fp8", *train_bench.RUNS["8b_fp8_b1"][2]], hardware=False)
    assert (cfg.training.local_batch_size, cfg.activation_checkpoint.mode) == (1, "none")  # the preset until 12-07


def test_loss_bench_reads_each_runs_curve_back_and_prints_the_gaps(tmp_path):
    """The loss check's mechanics on the CPU: two runs of the debug job through ./run_train.sh (the `fp8` run is
    the preset unchanged, which on the debug job means no FP8), curves read back from metrics.jsonl; the same
    seed gives the same curve, so every gap is zero (to 1e-5)."""
    import subprocess

    out = tmp_path / "loss.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/loss_bench.py"), "--config", "debug", "--runs",
                        "bf16,fp8", "--steps", "8", "--window", "4", "--scratch", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    curves = json.loads(out.with_suffix(".json").read_text())
    # the same job twice: equal up to the CPU's float reductions (1e-7 relative seen when another process ran)
    assert len(curves["bf16"]) == 8 and curves["bf16"] == pytest.approx(curves["fp8"], rel=1e-5)
    assert curves["bf16"][-1] < curves["bf16"][0]
    assert "| 1-4 |" in r.stdout and "| 5-8 |" in r.stdout and "+0.00%" in r.stdout
    assert "mean over the last 2 steps: bf16" in r.stdout


def test_breakdown_names_the_host_ops_that_queued_the_copies(tmp_path, capsys):
    """A copy kernel is traced back to the host ops open around its launch on the launching thread (the
    autograd thread's too), innermost with its input types and shapes; GEMMs are not explained."""
    step = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 1000 * i, "dur": 1000,
             "pid": 1, "tid": 1} for i in range(2)]
    ops = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::to", "ts": 100, "dur": 50, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 110, "dur": 30, "pid": 1, "tid": 1,
         "args": {"Input type": ["float", "c10::BFloat16", "Scalar"], "Input Dims": [[8, 4], [8, 4], []]}},
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: SliceBackward0", "ts": 300,
         "dur": 100, "pid": 1, "tid": 2},
    ]
    launches = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 2, "pid": 1,
                 "tid": tid, "args": {"correlation": c}} for c, t, tid in [(1, 120, 1), (2, 350, 2), (3, 500, 1)]]
    work = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": c}}
            for c, name, ts, dur in [(1, "direct_copy_kernel_cuda", 2000, 30),
                                     (2, "direct_copy_kernel_cuda", 2040, 10),
                                     (3, "nvjet_sm90_tst_128x256_TNT", 2060, 100)]]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": step + ops + launches + work}))
    train_bench.breakdown(trace)
    out = capsys.readouterr().out
    assert "queued by, for 0.04 ms of direct_copy_kernel_cuda:" in out, out
    assert "0.03 ms  aten::to > aten::copy_ [float [8, 4], c10::BFloat16 [8, 4]]" in out, out
    assert "0.01 ms  autograd::engine::evaluate_function: SliceBackward0" in out, out
    assert "queued by, for 0.10 ms of nvjet" not in out


def test_breakdown_names_what_ended_each_idle_gap(tmp_path, capsys):
    """An idle gap on the GPU is put on the host op chain that queued the work after it: "host-bound" when that
    work was queued only after the GPU ran dry, "queued earlier" when it waited for something else."""
    step = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 1000 * i, "dur": 1000,
             "pid": 1, "tid": 1} for i in range(2)]
    ops = [{"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}
           for name, ts, dur in [("aten::mm", 40, 20), ("optimizer_prep", 100, 400), ("aten::add", 540, 20)]]
    launches = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 2, "pid": 1,
                 "tid": 1, "args": {"correlation": c}} for c, t in [(1, 50), (2, 480), (3, 550)]]
    work = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": c}}
            for c, name, ts, dur in [(1, "nvjet_sm90_gemm", 60, 140),  # GPU idle 200-490: the host was behind
                                     (2, "adam", 490, 110),  # idle 600-900: queued at 550, started late
                                     (3, "vectorized_elementwise_kernel", 900, 50)]]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": step + ops + launches + work}))
    parts = train_bench.breakdown(trace)
    out = capsys.readouterr().out
    assert abs(parts["idle"] - 0.59) < 1e-9, parts
    assert "0.29 ms     1.0 gaps per step  host-bound      at  48% of its step  optimizer_prep" in out, out
    assert "0.30 ms     1.0 gaps per step  queued earlier  at  55% of its step  aten::add" in out, out


def test_cast_probe_finds_autograds_gradient_cast_and_names_the_line_of_each_cast(tmp_path):
    """A bf16 gradient for an FP32 tensor is cast by autograd (what FP8 weights of FP32 nominal dtype cost); the
    table lists it first by bytes with its shape and dtypes; small casts under min_numel are left out."""
    import torch

    import cast_probe

    class Bf16Grad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.to(torch.bfloat16).sum()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(64, 32, dtype=torch.bfloat16) * g

    w = torch.zeros(64, 32, requires_grad=True)
    recorder = cast_probe.CastRecorder(min_numel=1000)
    with recorder:
        Bf16Grad.apply(w).backward()
        torch.zeros(10).to(torch.float16)  # under min_numel
    assert w.grad.dtype == torch.float32
    casts = {(shape, src, dst): n for (shape, src, dst, _), n in recorder.seen.items()}
    assert casts == {((64, 32), torch.float32, torch.bfloat16): 1, ((64, 32), torch.bfloat16, torch.float32): 1}
    rows = cast_probe.table(recorder.seen)
    assert rows[2].startswith("| 1 | [64, 32] | ") and "tests/test_benchmarks.py:" in rows[2]


def test_cast_probe_runs_a_training_step_and_names_our_lines(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/cast_probe.py"), "--config", "debug", "--min_numel", "1",
                        "--warmup", "1", "--model.backend=torch", "--training.device=cpu",
                        f"--job.dump_folder={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dtype casts of >= 1 elements in step 2" in r.stdout
    assert "| int64 -> float32 | 0.0 | titan_te/trainer.py:" in r.stdout  # the step's token count
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/cast_probe.py"), "--config", "debug",
                          "--training.steps_typo=3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("config error: unknown key training.steps_typo")


def test_a_run_is_compared_with_the_peer_taking_as_many_tokens_per_optimizer_step():
    """A gradient-accumulating row's ratio is to the peer accumulating as many sequences a step; a row without such
    a peer in the run (batch 2 at 8B) keeps the size's plain peer, as before."""
    def result(tok_s, tokens):
        return {"tok_s": tok_s, "tokens": tokens, "tflops": 1.0, "tflops_causal": 1.0, "peak_gib": 1.0,
                "step_s": tokens / tok_s, "parts": {}}

    results = {"8b_fp8_ga4": result(15_000, 4 * 8192), "8b_fp8_b2_mlp4": result(15_200, 2 * 8192),
               "8b_peer": result(11_000, 8192), "8b_peer_ga4": result(12_000, 4 * 8192)}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1] for line in train_bench.tables(results).splitlines()
            if line.startswith("| 8b_") and "%" in line}
    assert rows == {"8b_fp8_ga4": "1.250x |", "8b_fp8_b2_mlp4": "1.382x |", "8b_peer": "1.000x |",
                    "8b_peer_ga4": "1.000x |"}
    # the 8B preset takes two sequences: beside the peer at two (8b_peer_b2) where that ran
    results = {"8b_fp8": result(15_000, 2 * 8192), "8b_fp8_b1": result(14_500, 8192),
               "8b_peer": result(11_000, 8192), "8b_peer_b2": result(12_000, 2 * 8192)}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1] for line in train_bench.tables(results).splitlines()
            if line.startswith("| 8b_") and "%" in line}
    assert rows == {"8b_fp8": "1.250x |", "8b_fp8_b1": "1.318x |", "8b_peer": "1.000x |", "8b_peer_b2": "1.000x |"}


def test_memory_peak_names_what_was_allocated_at_the_peak(tmp_path, capsys):
    """benchmarks/memory_peak.py on a snapshot in torch's format (CUDA's own needs a GPU): 5 GiB held when the
    recording began (the segments' active blocks at the end less the trace's allocations plus its frees), 1 GiB of it
    freed first, then 1 GiB in the head, 2 GiB in torch, the head's freed, 0.5 GiB in the head again: the peak is
    4 + 3 GiB, with the head's 1 GiB and torch's 2."""
    import pickle

    import memory_peak

    G = 2**30
    head = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 7, "name": "linear"},
            {"filename": "/repo/titan_te/models/llama/head.py", "line": 120, "name": "_loss_and_grads"}]
    torch_frames = [{"filename": "/x/site-packages/torch/autograd/graph.py", "line": 3, "name": "backward"}]
    trace = [{"action": "free_completed", "addr": 99, "size": G, "frames": []},  # made before the recording
             {"action": "alloc", "addr": 1, "size": G, "frames": head},
             {"action": "alloc", "addr": 2, "size": 2 * G, "frames": torch_frames},
             {"action": "free_requested", "addr": 1, "size": G, "frames": head},
             {"action": "free_completed", "addr": 1, "size": G, "frames": head},
             {"action": "alloc", "addr": 3, "size": G // 2, "frames": head}]
    blocks = [{"size": 4 * G, "state": "active_allocated"}, {"size": 2 * G, "state": "active_allocated"},
              {"size": G // 2, "state": "active_allocated"}, {"size": G, "state": "inactive"}]
    path = tmp_path / "step-3.pickle"
    path.write_bytes(pickle.dumps({"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}))
    found = memory_peak.peak(pickle.loads(path.read_bytes()))
    assert (found["peak"], found["before"]) == (7 * G, 4 * G)
    assert found["rows"] == [(2 * G, "/x/site-packages/torch/autograd/graph.py:3 backward"),
                             (G, "models/llama/head.py:120 _loss_and_grads")]
    assert memory_peak.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("peak 7.00 GiB allocated; 4.00 GiB of it from before recording")
    assert "| 1.000 | models/llama/head.py:120 _loss_and_grads |" in out
    assert memory_peak.main([str(tmp_path / "none.pickle")]) == 2
    assert capsys.readouterr().err.startswith(f"memory_peak: {tmp_path / 'none.pickle'}: not a CUDA memory snapshot")
