"""Console logging: the ranks in LOG_RANK (default 0) print INFO, the others only warnings and errors.

Every line is tagged with the rank on multi-process runs. The run's log file (run_folder.py) gets
everything of its rank, whatever the console shows.
"""
from __future__ import annotations

import logging
import os
import sys


class SignalErrorsPass:
    """A handler mixin: an error a signal handler raised into the main thread while a line was being written
    (torch's RuntimeError when a data-loader worker dies) goes on to the code that logged the line, where the
    trainer turns it into its one line, instead of being printed and swallowed as a "--- Logging error ---"."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging's name
        if isinstance(sys.exc_info()[1], RuntimeError):
            raise  # logging calls handleError inside its `except`: this re-raises that error
        super().handleError(record)


class ConsoleHandler(SignalErrorsPass, logging.StreamHandler):
    pass


def setup_logging() -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    show = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip().isdigit()}
    if not any(r < world for r in show):  # e.g. LOG_RANK=5 on one process: never a silent run
        if rank == 0:
            print(f"warning: LOG_RANK={os.environ.get('LOG_RANK')} names no rank of this run ({world} "
                  f"process(es)); rank 0 prints", file=sys.stdout)
        show = {0}
    handler = ConsoleHandler(sys.stdout)
    prefix = f"[rank{rank}] " if world > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    handler.setLevel(logging.INFO if rank in show else logging.WARNING)
    log = logging.getLogger("titan_te")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
