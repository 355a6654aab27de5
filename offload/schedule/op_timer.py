"""Timing the ops of a profiled block (profile.py): the host clock on a CPU; on a GPU a pair
of CUDA events per op, read once after the step."""
from __future__ import annotations

import time
from typing import Any, Callable

from ..util import clock

__all__ = ["OpTimer"]


class OpTimer:
    """Op timing: the host clock on CPU; CUDA events on a GPU, resolved after the step
    (offload/util/clock.py: every pair waited for before it is read, as a block may run
    ops on a stream of its own)."""

    def __init__(self, device_type: str, new_event: Callable[[], Any] | None = None) -> None:
        self.cuda = device_type == "cuda"
        self._new_event = new_event or clock.cuda_event
        self._pending: list[tuple[Any, Any, Any, str]] = []

    def start(self):
        if self.cuda:
            ev = self._new_event()
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, record: Any, start, field_name: str = "time_s") -> None:
        if self.cuda:
            end = self._new_event()
            end.record()
            self._pending.append((record, start, end, field_name))
        else:
            setattr(record, field_name,
                    getattr(record, field_name) + time.perf_counter() - start)

    def resolve(self) -> None:
        pending, self._pending = self._pending, []
        for record, start, end, field_name in pending:
            setattr(record, field_name,
                    getattr(record, field_name) + clock.elapsed_s(start, end))
