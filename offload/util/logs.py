"""The `offload` logger in a distributed run: every line says which rank wrote it, and the
informational lines (the per-step stats among them) come from the ranks asked for only.

With `torchrun --nproc-per-node 8` and `OFFLOAD_LOG=INFO`, eight identical per-step lines
without a rank are noise that hides the one that differs. Warnings and errors concern the
rank that hit them, so every rank logs those. A single process (no WORLD_SIZE > 1, no
process group) sees its lines unchanged.

The filter sits on the `offload` logger itself, so it applies whatever handlers the
application configured; which ranks log is process-wide, like the logger's level, and set
from the latest context's `OFFLOAD_LOG_RANKS` at its entry (`configure`).
"""
from __future__ import annotations

import logging

from .ranks import current_rank

__all__ = ["configure", "LOGGER_NAME"]

LOGGER_NAME = "offload"
_PREFIX = "offload: "


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.ranks: tuple[int, ...] | None = (0,)  # None: every rank

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        if rank is None:
            return True
        if record.levelno < logging.WARNING and self.ranks is not None \
                and rank not in self.ranks:
            return False
        record.rank = rank  # for formatters that want it as a field
        msg = record.msg
        if isinstance(msg, str):
            # Our messages start with "offload: "; the rank goes right after the name.
            record.msg = (f"offload [rank {rank}]: {msg[len(_PREFIX):]}"
                          if msg.startswith(_PREFIX) else f"[rank {rank}] {msg}")
        return True


_filter = _RankFilter()
logging.getLogger(LOGGER_NAME).addFilter(_filter)


def configure(level: str | None, ranks: tuple[int, ...] | None) -> None:
    """Apply OFFLOAD_LOG (None leaves the level as the application set it) and
    OFFLOAD_LOG_RANKS (None: every rank logs INFO and DEBUG lines)."""
    _filter.ranks = ranks
    if level is None:
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    # Without any handler Python only shows WARNING and up; OFFLOAD_LOG=INFO must show
    # the per-step stats, so attach one stderr handler when the app configured none.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        # Our messages begin with "offload:" (they may reach an application's own handler
        # without the logger's name), so the level alone goes in front.
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
