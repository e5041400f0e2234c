"""Background saves: copy the state off the live tensors (staging), then write it with `dcp.save`.

Both happen in one worker thread of our own, so nothing depends on the stager protocol of
`dcp.async_save`, which changed between torch releases (in torch 2.11 `DefaultStager` closes its
`StateDictStager` after every stage, so a second `async_save` with the same stager fails with
`KeyError: <class 'type'>`: pytorch/pytorch#183413).

Staging walks the state dict and copies every tensor (plain, DTensor or TE QuantizedTensor) into a CPU
buffer on a side CUDA stream that first waits for the work already queued on the training stream. With
`pinned` the buffers are page-locked and kept for the next save (the copies are then asynchronous DMA);
otherwise they are ordinary memory, allocated per save and freed once written. Training may go on
while staging runs; the optimizer must not change the weights before `wait_staged()` returns. One
save is in flight at a time, so the kept buffers are never written while a save still reads them.
"""
from __future__ import annotations

import copy
import warnings
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from titan_te.checkpoint import integrity
from titan_te.checkpoint.errors import is_environmental
from titan_te.errors import quiet_thread_failures


# Copying TE's FP8 tensors to the CPU (empty_like / _to_copy) makes TE warn on stderr that the result
# "may not" be an FP8 tensor "for FSDP2". The copies are for DCP, not FSDP, and are read back bit-exact
# (the GPU acceptance test), so the warning would only break the one-line stderr contract.
warnings.filterwarnings("ignore", message=r"A function call\(aten\.(empty_like|_to_copy)\.default\) in <class "
                                          r"'transformer_engine\.", category=UserWarning)


# DCP's writer threads let an exception escape (the failure also reaches dcp.save as the rank's error, which
# the manager reports in one line); an environmental one (disk full ...) is left to that line
quiet_thread_failures(lambda thread, err: "_write_files_from_queue" in (thread.name if thread else "")
                      and is_environmental(err))


class Stager:
    def __init__(self, device: torch.device, pinned: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pinned = pinned and self.cuda
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None

    def ready_event(self):
        """Marks the work queued so far on the training stream (call on the training thread)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @torch.no_grad()
    def stage(self, state, ready=None):
        """A CPU copy of `state` (call on the worker thread)."""
        if not self.cuda:
            return self._walk(state, ())
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            staged = self._walk(state, ())
        self._stream.synchronize()
        return staged

    def _walk(self, obj, path: tuple):
        if isinstance(obj, DTensor):
            # Same sharding spec, CPU local tensor: DCP's planner needs only the spec, no collectives.
            return DTensor(self._copy(obj._local_tensor, path), obj._spec, requires_grad=False)
        if torch.is_tensor(obj):
            return self._copy(obj, path)
        if isinstance(obj, dict):
            return {k: self._walk(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, path + (i,)) for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return obj
        return copy.deepcopy(obj)

    def _copy(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        buf = self._buffers.get(path) if self.pinned else None
        if buf is None or type(buf) is not type(t) or buf.shape != t.shape or buf.dtype != t.dtype:
            # empty_like keeps TE's QuantizedTensor type (its data, scales and transpose get CPU buffers)
            buf = torch.empty_like(t, device="cpu", pin_memory=self.pinned and t.is_cuda)
            if self.pinned:
                self._buffers[path] = buf
        buf.copy_(t.detach(), non_blocking=self.pinned and t.is_cuda)
        return buf

    def close(self) -> None:
        self._buffers.clear()


class BackgroundSave:
    """One save running in a worker thread: stage, then `dcp.save` over the given process group."""

    def __init__(self, stager: Stager, state: dict, path: Path, process_group, write_threads: int):
        self.path = path
        self.staged: Future = Future()
        self.written: Future = Future()
        ready = stager.ready_event()

        def run():
            try:
                cpu_state = stager.stage(state, ready)
            except BaseException as e:  # handed to the training thread, which decides what it means
                self.staged.set_exception(e)
                self.written.set_exception(e)
                return
            self.staged.set_result(None)
            try:
                files = write(cpu_state, path, process_group, write_threads)
            except BaseException as e:  # DCP's CheckpointException derives from BaseException
                self.written.set_exception(e)
                return
            self.written.set_result(files)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{path.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self.written.done()

    def result(self) -> dict:
        """Waits for the write; returns its files' checksums, or raises what the worker raised."""
        try:
            return self.written.result()
        finally:
            self._thread.join()


def write(state: dict, path: Path, process_group, write_threads: int) -> dict:
    """`dcp.save`, then the checksums of every file written ({name: [size, crc32]}, on every rank)."""
    writer = dcp.FileSystemWriter(str(path), thread_count=write_threads)
    dcp.save(state, storage_writer=writer, process_group=process_group)
    return integrity.record(path, process_group)
