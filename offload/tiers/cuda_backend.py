"""Every torch.cuda call of the copy path, in one place: the seam tests replace with a
simulated GPU (tests/sim_gpu.py), the process's copy streams, and the refusal to copy while
a CUDA graph captures.

Note 13 (streams reused across steps): the offload and prefetch streams are made once per
device and process (``_TorchCuda.copy_streams``), not per step. Reloaded tensors are
allocated on the prefetch stream (Note 6), and the caching allocator keeps a freed block for
reuse on the stream it was allocated on: with a new prefetch stream each step (torch hands
out its pool's 32 streams in turn) each step's reloads took fresh blocks, and reserved memory
grew step after step. Two contexts alive at once share the streams: their copies then queue
behind each other, while each CopyStreams still tracks only its own events.

Note 14 (CUDA graph capture): while the current stream captures a graph, work queued on it,
or on a stream that waits on an event recorded in the capture, is recorded into the graph
instead of running, and (in the default global capture mode) an event query or wait on the
host is refused and invalidates the capture. Offloading a captured step cannot work: the
copies would run only at replay, into blocks the arena has long reused. So every entry point
that queues a copy or waits raises :class:`GraphCaptureError` first (naming the way out), and
``poll`` (which only queries) does nothing while the stream captures, so a captured region
under ``offload.no_offload()`` stays legal. The engine's threads wait on our own events in
relaxed capture mode (csrc/cuda_copy.hpp ``enter_engine_thread``), so a capture on the
training thread neither fails their waits nor is invalidated by them.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..errors import OffloadError

__all__ = ["GraphCaptureError", "refuse_graph_capture", "after_fork_in_child",
           "forget_streams", "TorchCuda"]

_streams_lock = threading.Lock()
_streams: dict[torch.device, tuple] = {}   # Note 13


class GraphCaptureError(OffloadError, RuntimeError):
    """Offloaded tensors were to be moved while the current CUDA stream captures a graph."""


def refuse_graph_capture(what: str, capturing: bool) -> None:
    """Raise GraphCaptureError for `what` (the call, for the message) when `capturing` (Note 14)."""
    if capturing:
        raise GraphCaptureError(
            f"offload: {what} was called while the current CUDA stream is capturing a CUDA "
            "graph; saved tensors cannot be offloaded inside a captured region (their copies "
            "and the waits for them would be recorded into the graph instead of running). "
            "Capture the graph outside offload.activations(), or wrap the captured region in "
            "offload.no_offload()")


def after_fork_in_child() -> None:
    """A forked child cannot use the parent's CUDA streams (nor CUDA at all): forget them."""
    global _streams_lock
    _streams_lock = threading.Lock()
    _streams.clear()


def forget_streams() -> None:
    """Forget the process's copy streams (offload.process.reset); the next step makes new."""
    with _streams_lock:
        _streams.clear()


class TorchCuda:
    """Every torch.cuda call of this module, in one place (tests substitute a simulated GPU)."""

    def device(self, device: Any) -> torch.device:
        device = torch.device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"CopyStreams(device={str(device)!r}): needs a CUDA device "
                             "(on a CPU-only run the runtime keeps host tensors in place)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def copy_streams(self, device) -> tuple:
        """The process's offload and prefetch streams of `device` (Note 13)."""
        with _streams_lock:
            pair = _streams.get(device)
            if pair is None:
                pair = _streams[device] = (torch.cuda.Stream(device=device),
                                           torch.cuda.Stream(device=device))
            return pair

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def new_event(self, timing: bool, blocking: bool = False):
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.query()

    def synchronize(self, event) -> None:
        event.synchronize()

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def empty(self, nbytes: int, device, stream) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return host.is_pinned()

    def stream_handle(self, stream) -> int:
        return stream.cuda_stream

    def event_handle(self, event) -> int:
        return event.cuda_event


_TorchCuda = TorchCuda  # the name the tests' stand-ins subclass and patch
