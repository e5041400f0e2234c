"""Metrics: the console line, MFU and memory, and the values handed to the sinks (metric_sinks.py)."""
from __future__ import annotations

import logging
import math
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_te.metric_sinks import sinks_for

logger = logging.getLogger("titan_te")

# Dense bf16 peak FLOP/s by device-name fragment (MFU is always against bf16, also when FP8 is on).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12,
                   "GB200": 2500e12, "L40S": 362e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    return peak_for_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_for_name(name: str) -> float | None:
    """The peak of the GPU a device name names: the model is a word of it ("NVIDIA GB200" is a GB200, not
    a B200; "NVIDIA L40S" not an L4), whichever order the table is in."""
    words = set(re.split(r"[\s_-]+", name.upper()))
    found = [k for k in PEAK_BF16_FLOPS if k.upper() in words]
    return PEAK_BF16_FLOPS[max(found, key=len)] if found else None


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak active, peak reserved) GiB on the GPU; on CPU the process's peak RSS twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss


def causal_flops_per_token(args, seq_len: int) -> float:
    """FLOPs per token by Megatron's count (causal attention halved), for comparing with its tables; a model
    whose args do not split out attention counts as flops_per_token."""
    attention = getattr(args, "attention_flops_per_token", None)
    return args.flops_per_token(seq_len) - (0.5 * attention(seq_len) if attention else 0.0)


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class DeviceValues:
    """A step's scalars, still on the device, and the moment the step ended: copied to host memory without
    waiting; `get()` waits for the copy.

    The step's time is measured between step ends, never between the moments the host reads them (the host
    reads a step's values late and at uneven points: after the next step is queued, before a save, at the
    end of the loop). On a GPU the end is an event recorded after the step's last kernel, and the time
    between two events is the wall time between the two step ends, idle gaps included; on the CPU the
    step has ended when `train_step` returns. The event follows the copy to host memory: recorded before
    it, `get()` read the host buffer while the copy could still be queued (under a busy GPU, a healthy
    step read back as loss NaN, grad norm NaN)."""

    def __init__(self, values: torch.Tensor | None, device: torch.device):
        self.event = None
        self.ended = time.perf_counter()
        self.host = None
        if values is not None and device.type == "cuda":
            self.host = values.detach().to("cpu", non_blocking=True)
        elif values is not None:
            self.host = values.detach()
        if device.type == "cuda":  # after the copy: waiting for the event waits for the copy too
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    @classmethod
    def start(cls, device: torch.device) -> "DeviceValues":
        """The mark a loop's first step is timed from."""
        return cls(None, device)

    def get(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def seconds_since(self, earlier: "DeviceValues") -> float:
        if self.event is not None and earlier.event is not None:
            self.event.synchronize()
            return earlier.event.elapsed_time(self.event) / 1e3
        return self.ended - earlier.ended


@dataclass
class StepStats:
    step: int
    loss: float
    max_loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens this step on this rank
    step_time: float
    data_time: float
    epoch: int = 0


@dataclass
class PendingStep:
    """A finished step whose values are still on the device: [loss, worst rank's loss, grad norm, stop votes]."""

    values: DeviceValues
    step: int
    lr: float
    epoch: int
    data_time: float
    tokens: int  # on this rank


class MetricsLogger:
    """The console line every `log_freq` steps, and every value into the sinks (TensorBoard, JSON Lines).

    A step's values are read one step late (`step_done` reads the step before): the host never waits for
    the GPU in between. Anything else written (validation, FP8 statistics, checkpoint times) first reads the
    step still pending, so the console and the files stay in step order. The step values also carry how
    many ranks were asked to stop (`stop_votes`): every rank reads the same steps at the same points, so all
    of them see a stop request at the same step."""

    def __init__(self, mcfg, run_folder: Path, device: torch.device, rank: int, flops_per_token: float,
                 total_steps: int, start_step: int = 0, causal_flops_per_token: float | None = None):
        self.cfg, self.device, self.rank = mcfg, device, rank
        self.flops_per_token, self.total_steps = flops_per_token, total_steps
        self.causal_flops_per_token = causal_flops_per_token or flops_per_token
        self.peak = peak_flops(device)
        self.sinks = sinks_for(mcfg, run_folder, rank, start_step)
        self.losses: list[float] = []  # the global average loss of every step read, for callers and tests
        self.stop_votes = 0.0
        self.nonfinite: StepStats | None = None  # the first step read whose loss or grad norm is NaN / inf
        self._pending: PendingStep | None = None
        self._last_end: DeviceValues | None = None
        self._window_steps, self._window_tokens, self._window_time, self._window_data = 0, 0, 0.0, 0.0
        self.started = time.perf_counter()
        self.total_tokens, self.total_time, self.steps_done = 0, 0.0, 0

    def start_loop(self) -> None:
        """The first step of a training loop is timed from here."""
        self._last_end = DeviceValues.start(self.device)

    def step_done(self, pending: PendingStep) -> None:
        """Read and log the step before this one (its work is done by now), and keep this one pending."""
        self.flush()
        self._pending = pending

    def flush(self) -> None:
        """Read and log the pending step now (before a save, at the end of the loop)."""
        if self._pending is None:
            return
        p, self._pending = self._pending, None
        loss, max_loss, gnorm, votes = p.values.get()
        step_time, self._last_end = p.values.seconds_since(self._last_end), p.values
        self.losses.append(loss)
        self.stop_votes = max(self.stop_votes, votes)
        stats = StepStats(p.step, loss, max_loss, gnorm, p.lr, p.tokens, step_time, p.data_time, p.epoch)
        if self.nonfinite is None and not (math.isfinite(loss) and math.isfinite(gnorm)):
            self.nonfinite = stats
        self.record(stats)

    def record(self, s: StepStats) -> dict | None:
        """Accumulate one step; every log_freq steps (and the last) print and write. Returns the values."""
        self._window_steps += 1
        self._window_tokens += s.tokens
        self._window_time += s.step_time
        self._window_data += s.data_time
        self.total_tokens += s.tokens
        self.total_time += s.step_time
        self.steps_done += 1
        if s.step % self.cfg.log_freq and s.step not in (1, self.total_steps) and s is not self.nonfinite:
            return None
        tps = self._window_tokens / max(self._window_time, 1e-9)
        tflops = tps * self.flops_per_token / 1e12
        active, reserved = memory_gib(self.device)
        values = {
            "loss_metrics/global_avg_loss": s.loss,
            "loss_metrics/global_max_loss": s.max_loss,
            "grad_norm": s.grad_norm,
            "lr": s.lr,
            "throughput(tps)": tps,
            "tflops": tflops,
            "tflops_causal": tps * self.causal_flops_per_token / 1e12,  # Megatron's count: causal attention halved
            "memory/max_active(GiB)": active,
            "memory/max_reserved(GiB)": reserved,
            "time/step_s": self._window_time / max(self._window_steps, 1),
            "time/data_loading(%)": 100.0 * self._window_data / max(self._window_time, 1e-9),
        }
        if self.peak:
            values["mfu(%)"] = 100.0 * tflops * 1e12 / self.peak
        eta = (self.total_steps - s.step) * self.total_time / max(self.steps_done, 1)
        mfu = f"{values['mfu(%)']:.1f}%" if self.peak else "n/a"
        logger.info(f"step {s.step:>6}  loss {s.loss:8.4f}  lr {s.lr:.2e}  gnorm {s.grad_norm:7.3f}  "
                    f"tps {tps:,.0f}  tflops {tflops:.2f}  mfu {mfu}  mem {active:.2f}GiB  "
                    f"epoch {s.epoch}  eta {format_eta(eta)}")
        self._to_sinks(values, s.step)
        self._window_steps, self._window_tokens, self._window_time, self._window_data = 0, 0, 0.0, 0.0
        return values

    def write(self, values: dict, step: int) -> None:
        """Values logged outside the per-step line (validation, FP8 statistics, checkpoint times); the
        pending step is logged first."""
        self.flush()
        self._to_sinks(values, step)

    def _to_sinks(self, values: dict, step: int) -> None:
        for sink in self.sinks:
            sink.write(values, step)

    def summary(self, step: int, tokens_seen: int, tokens_per_step: int, checkpoints: str) -> str:
        """The run's last line."""
        active, _ = memory_gib(self.device)
        wall = time.perf_counter() - self.started
        where = "; ".join(s.hint() for s in self.sinks if s.alive) or "TensorBoard off"
        return (f"done: step {step} of {self.total_steps}, {tokens_seen:,} tokens in the whole run; this process: "
                f"{self.steps_done} steps, {self.steps_done * tokens_per_step:,} tokens, {wall:.1f}s wall, "
                f"{self.total_tokens / max(self.total_time, 1e-9):,.0f} tokens/s per rank, peak memory {active:.2f} "
                f"GiB; {checkpoints}; {where}")

    def close(self) -> None:
        self.flush()
        for sink in self.sinks:
            sink.close()
