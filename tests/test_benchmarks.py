"""The benchmark's own arithmetic (the GPU runs themselves are benchmarks, not tests)."""
import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import train_bench  # noqa: E402


def test_breakdown_sorts_kernels_into_categories_and_counts_idle_once(tmp_path):
    events = [  # µs; two streams overlap between 40 and 50
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_128x256_TNT", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "ts": 30, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "adam_fp8", "ts": 60, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 70, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel<gpu_kernel_impl_nocast<CUDAFunctor_add<float>>",
         "ts": 75, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "cast_transpose_fusion_kernel_optimized", "ts": 80, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host events are not GPU time
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    parts = train_bench.breakdown(trace, wall_us=200.0, steps=2)
    assert parts["gemm"] == 0.02 and parts["attention"] == 0.01 and parts["optimizer"] == 0.005  # ms per step
    assert parts["copies/comm"] == 0.0025 and parts["other"] == 0.0025  # "nocast" is not a cast
    assert parts["cast/transpose"] == 0.005
    assert parts["idle"] == (200 - 80) / 2 / 1e3  # busy: 0-50, 60-90 (the overlap counted once)
    assert parts["busy_pct"] == 40.0


def test_train_bench_runs_a_preset_on_several_ranks_and_prints_the_scaling(tmp_path):
    """--ngpu N starts N ranks of the preset run (NCCL on GPUs; here gloo on the CPU, so only the mechanics
    are checked: every rank runs, rank 0 reports, tokens/s is per GPU, the JSON feeds the planner)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "bench.json"
    cpu = ["--model.backend=torch", "--fp8.enable=false", "--fp8.params=false", "--fp8.head=off",
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


def test_loss_bench_reads_each_runs_curve_back_and_prints_the_gaps(tmp_path):
    """The loss check's mechanics on the CPU: two runs of the debug job through ./run_train.sh (the `fp8` run is
    the preset unchanged, which on the debug job means no FP8), curves read back from metrics.jsonl; the same
    seed gives the same curve, so every gap is zero."""
    import subprocess

    out = tmp_path / "loss.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/loss_bench.py"), "--config", "debug", "--runs",
                        "bf16,fp8", "--steps", "8", "--window", "4", "--scratch", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    curves = json.loads(out.with_suffix(".json").read_text())
    assert len(curves["bf16"]) == 8 and curves["bf16"] == curves["fp8"] and curves["bf16"][-1] < curves["bf16"][0]
    assert "| 1-4 |" in r.stdout and "| 5-8 |" in r.stdout and "+0.00%" in r.stdout
    assert "mean over the last 2 steps: bf16" in r.stdout
