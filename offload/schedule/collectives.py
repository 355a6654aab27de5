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
a copy of every tensor a collective writes or makes, as it was after it (taken at the
first op that uses one of them, after the caller waited for it); its re-run runs under
`HandBack`, which does not call the collective: it writes those copies into the re-run's
own tensors (the re-run reached the collective with the forward's values, so this is
what the collective would have left there; an input it only reads is left alone) and
returns the forward's results, with a `Work` that is done. The forward also tells the
session (`on_call`), which runs the block as it is from then on and profiles its class
again. A re-run that reaches
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


def _handed(func, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors a collective was handed, in order, and the indices of those it writes:
    an argument its schema marks written (functional collectives), or, c10d's schemas
    marking none, one named an output (`output_tensors`, `output`) or the `tensors` of any
    op but `send` (all_reduce, broadcast, recv)."""
    handed: list[torch.Tensor] = []
    written: list[int] = []
    for n, arg in enumerate(func._schema.arguments):
        value = args[n] if n < len(args) else kwargs.get(arg.name)
        writes = (arg.alias_info is not None and arg.alias_info.is_write) or (
            func.namespace == "c10d" and (arg.name.startswith("output") or (
                arg.name == "tensors" and func._opname != "send")))
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                if writes:
                    written.append(len(handed))
                handed.append(t)
    return handed, written


class _Kept:
    """One collective call of a forward: the shapes of the tensors it was handed, the
    values of those it writes as they were after it (`after`, by index), and its result
    with each tensor in it either a handed one (`handed_at`) or a copy of one it made
    (`made`). A `Work` in it is not held (its tensors lead back to the checkpoint that holds
    this: a cycle through C++ that Python's collector cannot free): the re-run gets one that
    is done. Made with `copy=False`, it holds the tensors themselves (detached: the graph of
    one leads back to the checkpoint, the same cycle) and reads their values when a re-run
    needs them (`read`)."""

    __slots__ = ("shapes", "after", "spec", "results", "handed_at", "made", "versions",
                 "func")

    def __init__(self, func, handed: list[torch.Tensor], written: list[int], out: Any,
                 copy: bool = True) -> None:
        self.func = func
        self.shapes = [(t.shape, t.dtype) for t in handed]
        self.results, self.spec = tree_flatten(out)
        self.handed_at: dict[int, int] = {}
        self.made: dict[int, torch.Tensor] = {}
        where = {id(t): i for i, t in enumerate(handed)}
        for i, r in enumerate(self.results):
            if isinstance(r, torch.Tensor):
                if id(r) in where:
                    self.handed_at[i] = where[id(r)]
                    if where[id(r)] not in written:   # (a functional recv returns its own)
                        written.append(where[id(r)])
                else:
                    self.made[i] = r.detach()
        self.after = {i: handed[i].detach() for i in written}
        self.results = [None if isinstance(r, torch.Tensor) else _DONE if _is_work(r) else r
                        for r in self.results]
        self.versions: list[int] | None = None
        if copy:
            self._copy()
        else:   # read at the re-run: the tensors themselves, and their versions now
            self.versions = self._versions()

    def _tensors_held(self) -> list[torch.Tensor]:
        return [*self.after.values(), *self.made.values()]

    def _versions(self) -> list[int]:
        return [t._version for t in self._tensors_held()]

    def _copy(self) -> None:
        self.after = {i: t.clone() for i, t in self.after.items()}
        self.made = {i: t.clone() for i, t in self.made.items()}

    def read(self, block_name: str) -> None:
        """A pending one's values, now (the first re-run): as the forward left them, unless
        something changed them in place since."""
        if self.versions is None:
            return
        if self._versions() != self.versions:
            raise RuntimeError(
                f"offload: a tensor {self.func} wrote in the forward of a {block_name} was "
                "changed in place after that forward, before its re-run in backward, which "
                "needs its value as the collective left it (collectives.py NOTE [A re-run "
                "calls no collective]). Use the collective's result inside the block, or "
                "leave it unchanged until the backward")
        if self.made and self.func.namespace != "c10d":
            _wait(self.func, [t for t in self.made.values()])
        self._copy()
        self.versions = None

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


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _wait(func, tensors: list[torch.Tensor]) -> None:
    """Wait for the pending work of a functional collective's output `tensors` (its own
    wait: one that was waited for returns at once)."""
    ops = getattr(torch.ops, func.namespace if func.namespace.endswith("c10d_functional")
                  else "_c10d_functional")
    for t in tensors:
        ops.wait_tensor(t)


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
    """A collective of the forward whose values are not kept yet: `storages`, those of the
    tensors it writes or makes."""

    __slots__ = ("key", "func", "handed", "written", "out", "storages")

    def __init__(self, key: tuple, func, handed: list[torch.Tensor], written: list[int],
                 out: Any) -> None:
        self.key, self.func, self.handed, self.written, self.out = key, func, handed, written, out
        made = [r for r in tree_flatten(out)[0] if isinstance(r, torch.Tensor)]
        self.storages = _storages([handed[i] for i in written]) | _storages(made)

    def kept(self, copy: bool = True) -> _Kept:
        return _Kept(self.func, self.handed, list(self.written), self.out, copy)


class KeepResults(TorchDispatchMode):
    """Forward: run each collective, and keep what it left (`_Kept`) at the first op that
    uses a tensor it writes or makes (before that op runs; after it when it is the wait of
    a functional collective): by then the caller waited for it (else plain training reads
    it half written too), and on a GPU that op comes after it in stream order. A tensor it
    only reads is not copied: the re-run reaches it with the same values. No wait of ours:
    a batch of sends and receives (`batch_isend_irecv`, a ring exchange) must all be posted
    before one is waited for, and a send whose receive comes after the block must not be
    waited for in it. What the forward never used is read when a re-run needs it
    (`_Kept.read`: as the forward left it, unless changed in place since)."""

    def __init__(self, kept: dict, on_call: Callable[[str], None]) -> None:
        super().__init__()
        self.kept = kept
        self.on_call = on_call
        self.counter: dict[Any, int] = defaultdict(int)
        self.started: list[_Started] = []   # not kept yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.started:   # (every op of the block: nothing but the check below)
            out = func(*args, **kwargs)
        elif func._opname in _WAITS and func.namespace in COLLECTIVE_NAMESPACES:
            out = func(*args, **kwargs)
            self._keep_used(args, kwargs)
        else:
            self._keep_used(args, kwargs)
            out = func(*args, **kwargs)
        if is_collective(func):
            n = self.counter[func]
            self.counter[func] = n + 1
            started = _Started((func, n), func, *_handed(func, args, kwargs), out)
            if started.storages:
                self.started.append(started)
            else:   # (a send, a barrier: nothing to read later)
                self.kept[started.key] = started.kept()
            self.on_call(str(func))
        return out

    def _keep_used(self, args: tuple, kwargs: dict) -> None:
        used = _storages(_tensors(args, kwargs))
        if not used:
            return
        still = []
        for started in self.started:
            if started.storages & used:
                self.kept[started.key] = started.kept()
            else:
                still.append(started)
        self.started = still

    def __exit__(self, exc_type, exc, tb):
        started, self.started = self.started, []
        if exc_type is None:
            for one in started:
                self.kept[one.key] = one.kept(copy=False)
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
        handed = _handed(func, args, kwargs)[0]
        if kept is None or [(t.shape, t.dtype) for t in handed] != kept.shapes:
            raise RuntimeError(
                f"offload: the re-run of a {self.block_name} in backward reached a collective "
                f"({func}, its call {n + 1}) that its forward "
                f"{'did not call' if kept is None else 'called with other tensors'}; calling "
                "it here would pair it with another rank's next collective (collectives.py "
                "NOTE [A re-run calls no collective]). Make the block call the same "
                "collectives in its forward and in a second run of it with the same inputs "
                "(no branch on state that changes between the forward and the backward)")
        kept.read(self.block_name)
        for i, after in kept.after.items():
            handed[i].copy_(after)
        return kept.results_for(handed)


def modes(on_call: Callable[[str], None], block_name: str
          ) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward's and the re-run's modes of one checkpointed block call, sharing what
    the forward kept. `on_call(op name)`: told of each collective the forward calls."""
    kept: dict = {}
    return KeepResults(kept, on_call), HandBack(kept, block_name)
