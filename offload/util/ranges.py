"""Profiler ranges: what offload does shows in the profiler the user already runs.

`offload::pack`, `offload::unpack` (a saved tensor), `offload::write` (an NVMe write batch
handed to the engine), `offload::d2h` (a copy to the host tier issued), `offload::wait_read`
(unpack getting its bytes from a read: waiting for it, or collecting one that landed),
`offload::prefetch` (read-ahead issued), `offload::recompute` (a checkpointed block run again
in backward) appear in `torch.profiler` traces
(`prof.key_averages()`, the Chrome trace); under `torch.autograd.profiler.emit_nvtx()` torch
sends the same ranges to NVTX, so Nsight Systems shows them on a GPU.

They are on whenever a profiler runs; when none does, each place pays one check of torch's
profiler flag (a C call: 40-60 ns measured with timeit on the 2-core dev VM), and a saved
tensor passes at most four such places (pack, write or copy issue, prefetch or wait, unpack).
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["profiling", "span", "NO_SPAN", "PACK", "UNPACK", "WRITE", "D2H", "WAIT_READ", "PREFETCH",
           "RECOMPUTE"]

profiling = torch._C._autograd._profiler_enabled

PACK = "offload::pack"
UNPACK = "offload::unpack"
WRITE = "offload::write"
D2H = "offload::d2h"
WAIT_READ = "offload::wait_read"
PREFETCH = "offload::prefetch"
RECOMPUTE = "offload::recompute"


# What `with span(X) if profiling() else NO_SPAN:` enters when no profiler runs.
NO_SPAN = contextlib.nullcontext()


def span(name: str) -> record_function:
    """A profiler range (use it only when `profiling()`: it costs ~µs to make)."""
    return record_function(name)
