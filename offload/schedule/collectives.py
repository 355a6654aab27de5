"""Collectives in a block `auto` checkpoints: its re-run hands back what the forward's got.

NOTE [A re-run calls no collective] Each rank plans `auto` on its own (its shape classes,
figures, trials and their winner), so one rank may re-run a block in backward that another
runs as it is. A collective the block calls (a tensor-parallel all_reduce, a statistic
synced every k steps) would then run a second time on the rank that re-runs it only, and
pair with another rank's next collective: wrong weights on one rank with no error, a
mismatch or a hang on another. A block a profile saw call one runs as it is on every rank
(plan_cache.py NOTE [Blocks run alike on every rank]); these two modes cover the block
that calls one only in a later step (a branch on the step, a flag): in a job of more than
one rank, every block `auto` checkpoints runs its forward under `KeepResults`, which keeps
a copy of every tensor a collective was handed, as it was after it (taken at the first op
that uses one of them, after the caller waited for it); its re-run runs under `HandBack`,
which does not call the collective: it writes those copies into the re-run's own tensors
that differ (the re-run reached the collective with the forward's values, so this is
what the collective would have left there; an input it only read is left alone) and
returns the forward's results, with a `Work` that is done. The forward also tells the session (`on_call`), which
runs the block as it is from then on and profiles its class again. A re-run that reaches
a collective its forward did not call, or one handed other tensors, raises before calling
it.

What it costs: a dispatch mode over every op of those blocks' forwards and re-runs in a job
of more than one rank (one name check per op: docs/benchmarks.md "Collectives in a
re-run"), and, in the one step that finds a collective, a copy of its tensors until the
backward. Not seen: a collective inside a compiled block (compiled
code runs under no mode of ours). A module hook on the block runs around its call,
outside the checkpoint, and never in a re-run.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["COLLECTIVE_NAMESPACES", "is_collective", "many_ranks", "modes"]

# The dispatcher namespaces of torch.distributed's collectives (`dist.all_reduce` runs
# c10d::allreduce_; functional collectives and DTensor's run _c10d_functional ops).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                   "_dtensor"})

# Waits on a functional collective's output: they run in both passes (a replayed output has
# no pending work, so its wait returns at once).
_WAITS = frozenset({"wait_tensor"})


_WORK = "__torch__.torch.classes.c10d.Work"


def is_collective(func) -> bool:
    """Whether the op `func` communicates with other ranks."""
    return func.namespace in COLLECTIVE_NAMESPACES and func._opname not in _WAITS


def many_ranks() -> bool:
    """Whether this process is one rank of a job of more than one."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _Kept:
    """One collective call of a forward: the tensors it was handed, as they were after it
    (`after`), and its result with each tensor in it either the handed one at that place
    (`handed_at`) or a copy of one it made (`made`); a `Work` in it is not held (its
    tensors lead back to the checkpoint that holds this: a cycle through C++ that Python's
    collector cannot free), the re-run gets one that is done."""

    __slots__ = ("after", "spec", "results", "handed_at", "made")

    def __init__(self, handed: list[torch.Tensor], out: Any) -> None:
        self.after = [t.detach().clone() for t in handed]
        self.results, self.spec = tree_flatten(out)
        self.handed_at: dict[int, int] = {}
        self.made: dict[int, torch.Tensor] = {}
        where = {id(t): i for i, t in enumerate(handed)}
        for i, r in enumerate(self.results):
            if isinstance(r, torch.Tensor):
                if id(r) in where:
                    self.handed_at[i] = where[id(r)]
                else:
                    self.made[i] = r.detach().clone()
        self.results = [None if isinstance(r, torch.Tensor) else _DONE if _is_work(r) else r
                        for r in self.results]

    def results_for(self, handed: list[torch.Tensor]) -> Any:
        """The result for a re-run handed `handed`."""
        results = [_done_work() if r is _DONE else r for r in self.results]
        for i, j in self.handed_at.items():
            results[i] = handed[j]
        for i, made in self.made.items():
            results[i] = made.clone()   # a second backward (retain_graph) needs it again
        return tree_unflatten(results, self.spec)


_DONE = object()   # where a forward's result held a Work


def _is_work(x: Any) -> bool:
    # (a dispatch mode sees c10d's Work as a TorchScript object)
    return isinstance(x, torch.ScriptObject) and x._type().qualified_name() == _WORK


def _done_work() -> Any:
    """A Work that is done, as a dispatch mode returns one."""
    future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def _unchanged(t: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether a re-run's tensor holds the values a collective left in the forward's
    already (one it only read: an input, maybe an expanded one, which cannot be written)."""
    if t.is_floating_point() or t.is_complex():
        return torch.allclose(t, after, rtol=0.0, atol=0.0, equal_nan=True)
    return torch.equal(t, after)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _wait(func, out: Any) -> None:
    """Wait for the collective `func` started unless it is done: its `Work` (waited for once
    only: a second wait for a gloo send waits for another send), or the pending work of a
    functional collective's output tensors (a wait of its own, idempotent)."""
    for r in tree_flatten(out)[0]:
        if _is_work(r):
            work = dist.Work.unbox(r)
            if not work.is_completed():
                work.wait()
        elif isinstance(r, torch.Tensor) and func.namespace != "c10d":
            getattr(torch.ops, func.namespace if func.namespace.endswith("c10d_functional")
                    else "_c10d_functional").wait_tensor(r)


def _storages(tensors) -> set:
    """Where `tensors` hold their data (device, address); a wrapper subclass (an
    AsyncCollectiveTensor, a DTensor) has none of its own."""
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                out.add((t.device, t.untyped_storage().data_ptr()))
            except (RuntimeError, NotImplementedError):
                pass
    return out


class _Started:
    __slots__ = ("key", "func", "handed", "out", "storages")

    def __init__(self, key: tuple, func, handed: list[torch.Tensor], out: Any) -> None:
        self.key, self.func, self.handed, self.out = key, func, handed, out
        self.storages = _storages(handed) | _storages(tree_flatten(out)[0])


class KeepResults(TorchDispatchMode):
    """Forward: run each collective, and keep what it left (`_Kept`) at the first op that
    uses one of its tensors (before that op runs; after it when it is the wait of a
    functional collective), or at the end of the forward. Not at once, and without a wait
    of ours: a batch of sends and receives (`batch_isend_irecv`, a ring exchange) must all
    be posted before one is waited for, or each rank waits for a peer that has not posted
    its half yet; and an op that reads a collective's tensor comes after the caller waited
    for it (else plain training reads it half written too): on a GPU, in stream order after
    it. Only at the end of the forward, for a tensor nothing in the block used, is one
    waited for (`_wait`)."""

    def __init__(self, kept: dict, on_call: Callable[[str], None]) -> None:
        super().__init__()
        self.kept = kept
        self.on_call = on_call
        self.counter: dict[Any, int] = defaultdict(int)
        self.started: list[_Started] = []   # not kept yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        waits = func._opname in _WAITS and func.namespace in COLLECTIVE_NAMESPACES
        if self.started and not waits:
            self._keep_used(args, kwargs)
        out = func(*args, **kwargs)
        if self.started and waits:
            self._keep_used(args, kwargs)
        if is_collective(func):
            n = self.counter[func]
            self.counter[func] = n + 1
            self.started.append(_Started((func, n), func, _tensors(args, kwargs), out))
            self.on_call(str(func))
        return out

    def _keep_used(self, args: tuple, kwargs: dict) -> None:
        used = _storages(_tensors(args, kwargs))
        if not used:
            return
        still = []
        for started in self.started:
            if started.storages & used:
                self.kept[started.key] = _Kept(started.handed, started.out)
            else:
                still.append(started)
        self.started = still

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                for started in self.started:
                    _wait(started.func, started.out)
                    self.kept[started.key] = _Kept(started.handed, started.out)
        finally:
            self.started = []
        return super().__exit__(exc_type, exc, tb)


class HandBack(TorchDispatchMode):
    """Re-run: call no collective; write and return what the forward's left (`_Kept`)."""

    def __init__(self, kept: dict, block_name: str) -> None:
        super().__init__()
        self.kept = kept
        self.block_name = block_name
        self.counter: dict[Any, int] = defaultdict(int)

    def __enter__(self):
        self.counter.clear()   # each re-run counts from its start (retain_graph: two)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_collective(func):
            return func(*args, **kwargs)
        n = self.counter[func]
        self.counter[func] = n + 1
        kept = self.kept.get((func, n))
        handed = _tensors(args, kwargs)
        if kept is None or [(t.shape, t.dtype) for t in handed] != \
                [(t.shape, t.dtype) for t in kept.after]:
            raise RuntimeError(
                f"offload: the re-run of a {self.block_name} in backward reached a collective "
                f"({func}, its call {n + 1}) that its forward "
                f"{'did not call' if kept is None else 'called with other tensors'}; calling "
                "it here would pair it with another rank's next collective (collectives.py "
                "NOTE [A re-run calls no collective]). Make the block call the same "
                "collectives in its forward and in a second run of it with the same inputs "
                "(no branch on state that changes between the forward and the backward)")
        for t, after in zip(handed, kept.after):
            if not _unchanged(t, after):
                t.copy_(after)
        return kept.results_for(handed)


def modes(on_call: Callable[[str], None], block_name: str
          ) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward's and the re-run's modes of one checkpointed block call, sharing what
    the forward kept. `on_call(op name)`: told of each collective the forward calls."""
    kept: dict = {}
    return KeepResults(kept, on_call), HandBack(kept, block_name)
