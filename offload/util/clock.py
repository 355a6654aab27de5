"""The clock `auto` times a step's windows and ops with: the host's on CPU, the device's on
CUDA.

On CUDA the host only launches work: a host time taken at the end of the forward is when
its last kernel was queued, not when it ran, and the window that hides transfers would read
far too small. Device time comes from CUDA events recorded on the current stream at the
window edges and read once the step is over. `elapsed_time` needs both of its events done:
each is synchronized before it is read (an event of a side stream is not done because a
later event of another stream is).

`new_event` is the seam tests replace with a fake device clock (tests/test_clock.py), as
offload/tiers/copies.py's `_TorchCuda` is for the copy paths.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["HostClock", "DeviceClock", "clock_for", "cuda_event", "elapsed_s"]


def cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def elapsed_s(start: Any, end: Any) -> float:
    """Seconds between two recorded CUDA events, each waited for first (module doc)."""
    start.synchronize()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class HostClock:
    """Marks are `time.perf_counter()` seconds (a host time already taken may be passed)."""

    device = False

    def mark(self, host_s: float | None = None) -> float:
        return time.perf_counter() if host_s is None else host_s

    def seconds(self, start: float, end: float) -> float:
        return end - start


class DeviceClock:
    """Marks are events recorded on the current stream; `seconds` waits for both."""

    device = True

    def __init__(self, new_event: Callable[[], Any] | None = None) -> None:
        self._new_event = new_event or cuda_event

    def mark(self, host_s: float | None = None) -> Any:
        event = self._new_event()
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return elapsed_s(start, end)


def clock_for(device_type: str) -> HostClock | DeviceClock:
    return DeviceClock() if device_type == "cuda" else HostClock()
