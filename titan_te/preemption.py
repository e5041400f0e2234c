"""SIGTERM, SIGINT and SIGHUP from the first line of `main` to the last.

One handler, installed by every entry point before it does anything, answers by phase:
- starting (imports, config, data, model build, resume) and in the `prepare` / `export` tools: the
  first signal raises `Interrupted` (one line, exit 128 + N): nothing of the run is half-written, since
  every save and publish is atomic and an interrupted one leaves only a `.tmp` the next start removes.
  Not inside an import, though: a module left half-initialized breaks the next use of it before the
  exception gets out (torch imports lazily; numpy.linalg then recursed until a RecursionError), so the
  request is delivered again every DEFER_S until the main thread is out of the import;
- training: the first signal sets a flag; every rank finishes the step, saves, and exits 75;
- finishing (after the loop, while the process tears down): nothing more happens, the exit code
  stays what the run decided (75 after a stop save).
The same signal often arrives twice within moments: Slurm and a terminal's Ctrl-C signal the whole
process group, and the launcher forwards what it receives to its workers as well. Repeats within
REPEAT_WINDOW_S count as one request; a repeat after that exits at once. A closed terminal (SIGHUP)
is a stop request like SIGTERM.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

from titan_te.errors import Interrupted, Preempted, say

logger = logging.getLogger("titan_te")
EXIT_PREEMPTED = Preempted.exit_code
REPEAT_WINDOW_S = 3.0
DEFER_S = 0.02  # how often a start-up interruption that came inside an import is tried again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def preempted(step: int, saved: bool) -> Preempted:
    return Preempted(f"stopped by a signal after step {step}"
                     + ("; checkpoint saved, rerun the same command to resume" if saved else
                        "; checkpointing is off, nothing was saved"))


class StopSignals:
    """The process's stop requests (one instance: SIGNALS)."""

    def __init__(self):
        self.phase = "starting"  # starting | training | finishing
        self.flag = False
        self.what = "starting"  # what the process was doing, for the one line of an interruption
        self._first = 0.0
        self._old: dict = {}
        self._depth = 0
        self._pid = 0
        self.decided: int | None = None  # the exit code the run has settled on (75 after a stop save), kept by a late exit
        self.interrupted: Interrupted | None = None  # raised while starting (kept: see training())
        self._again = False  # the next call of the handler is a deferred interruption, delivered again

    def _handler(self, signum, frame):
        if os.getpid() != self._pid:
            return  # a forked helper (a data-loader worker): the process that installed the handler decides
        if self._again:
            self._again = False
            return self._interrupt(signum, frame)
        now = time.monotonic()
        if self.flag:
            if now - self._first < REPEAT_WINDOW_S:
                return  # the same request, delivered twice (process group + launcher)
            os._exit(128 + signum if self.decided is None else self.decided)  # asked again: no more waiting
        self.flag, self._first = True, now
        name = signal.Signals(signum).name
        if self.phase == "starting":
            return self._interrupt(signum, frame)
        if self.phase == "training":
            logger.warning(f"received {name}: finishing this step, then saving and exiting (send it again to "
                           f"exit at once)")
        else:
            logger.warning(f"received {name} while finishing the run; send it again to exit at once")

    def _interrupt(self, signum, frame) -> None:
        """Raise the start-up interruption where the main thread is, or, inside an import, a moment later."""
        if self.phase != "starting":
            return  # training began meanwhile: the flag is a stop request there (a step, a save, exit 75)
        if _inside_import(frame):
            def again():
                if signal.getsignal(signum) == self._handler:  # still this process's entry point
                    self._again = True
                    signal.pthread_kill(threading.main_thread().ident, signum)  # the main thread, as before

            timer = threading.Timer(DEFER_S, again)
            timer.daemon = True
            timer.start()
            return
        self.phase = "finishing"  # whatever the raise unwinds through is not interrupted again
        self.interrupted = Interrupted(signum, self.what)
        raise self.interrupted

    def stop_behind(self, err: BaseException) -> Interrupted | None:
        """The start-up interruption that `err` is, or that a library turned into `err` (DCP's load wraps what a
        read raises in a CheckpointException, a BaseException); None when `err` is an error of its own."""
        if isinstance(err, Interrupted):
            return err
        return None if isinstance(err, SystemExit) else self.interrupted

    def report_stop(self, err: BaseException) -> int | None:
        """For an entry point's last except: says the line of the stop behind `err` and returns its exit code;
        None when `err` is an error of its own (the caller re-raises it)."""
        stop = self.stop_behind(err)
        if stop is None:
            return None
        say(stop.line())
        return stop.exit_code

    @contextlib.contextmanager
    def installed(self, for_good: bool = False):
        """Handlers on for the life of an entry point (the main thread only; nested calls share them).
        `for_good`: the process exits right after with the code it has decided: from then on the stop
        signals are ignored (Python's own teardown would reset a handler to the default, and a late repeat
        of the signal would turn a saved stop's exit 75 into a kill)."""
        main = threading.current_thread() is threading.main_thread()
        if main and self._depth == 0:
            self.phase, self.flag, self.what, self._pid, self.decided = "starting", False, "starting", os.getpid(), None
            self.interrupted = None
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        self._depth += main
        try:
            yield self
        finally:
            self._depth -= main
            if main and self._depth == 0:
                for s, h in self._old.items():
                    signal.signal(s, signal.SIG_IGN if for_good else h)
                self._old.clear()

    def install_early(self) -> None:
        """For a tool run as __main__, before its heavy imports: until its main() takes over, a stop signal
        prints the one line and exits at once (nothing has been written yet)."""
        def early(signum, frame):
            say(Interrupted(signum, "starting").line())
            os._exit(128 + signum)

        for s in STOP_SIGNALS:
            signal.signal(s, early)

    def doing(self, what: str) -> None:
        """Names the start-up stage, for the line an interruption prints."""
        self.what = what

    @contextlib.contextmanager
    def training(self):
        """The training loop: a signal becomes a stop request (the handlers are installed here too when
        the caller is not an entry point, e.g. a test driving a Trainer)."""
        with self.installed():
            if self.interrupted is not None:
                # a signal while starting whose Interrupted did not get out: the handler runs wherever the main
                # thread is, and an exception raised inside a __del__ or a library's own `except` is dropped
                raise self.interrupted
            self.phase = "training"
            try:
                yield self
            finally:
                self.phase = "finishing"


def _inside_import(frame) -> bool:
    """Whether `frame` runs inside an import (importlib's frames are on the stack while a module executes)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


SIGNALS = StopSignals()
