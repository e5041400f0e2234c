"""Console logging: rank LOG_RANK prints (default 0), every line tagged with the rank."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    show = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip()}
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    log = logging.getLogger("titan_te")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank in show else logging.WARNING)
