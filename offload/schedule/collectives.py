"""Collectives in a block `auto` checkpoints: its re-run hands back what the forward's got.

NOTE [A re-run calls no collective] Each rank plans `auto` on its own (its shape classes,
figures, trials and their winner), so one rank may re-run a block in backward that another
runs as it is. A collective the block calls (a tensor-parallel all_reduce, a statistic
synced every k steps) would then run a second time on the rank that re-runs it only, and
pair with another rank's next collective: wrong weights on one rank with no error, a
mismatch or a hang on another. A block a profile saw call one runs as it is on every rank
(plan_cache.py NOTE [Blocks run alike on every rank]); these two modes cover the block
that calls one only in a later step (a branch on the step, a flag): in a job of more than
one rank, every block `auto` checkpoints runs its forward under `KeepResults`, which
waits for each collective it calls and keeps a copy of every tensor the collective was
handed, as it was after it; its re-run runs under `HandBack`, which does not call the
collective: it writes those copies into the re-run's own tensors (the re-run reached the
collective with the forward's values, so this is what the collective would have left
there) and returns the forward's results, its `Work` too. The forward also tells the
session (`on_call`), which runs the block as it is from then on and profiles its class
again. A re-run that reaches a collective its forward did not call, or one handed other
tensors, raises before calling it.

What it costs: a dispatch mode over every op of those blocks' forwards and re-runs in a job
of more than one rank (one name check per op), and, in the one step that finds a
collective, a copy of its tensors until the backward, plus a wait for it in the forward
(an `async_op=True` collective does not overlap with the rest of that forward).
Not seen: a collective inside a compiled block (compiled code runs under no mode of ours),
and one called by a module hook outside the block's forward.
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
    (`handed_at`) or a copy of one it made (`made`)."""

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
        # Only non-tensor results (a Work, done) are held as themselves.
        self.results = [None if isinstance(r, torch.Tensor) else r for r in self.results]


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _wait(func, out: Any) -> None:
    """Wait for the collective `func` just started: its `Work`, or the pending work of a
    functional collective's output tensors."""
    for r in tree_flatten(out)[0]:
        if isinstance(r, torch.ScriptObject) and r._type().qualified_name() == _WORK:
            r.wait()   # (a dispatch mode sees c10d's Work as a TorchScript object)
        elif isinstance(r, torch.Tensor) and func.namespace != "c10d":
            getattr(torch.ops, func.namespace if func.namespace.endswith("c10d_functional")
                    else "_c10d_functional").wait_tensor(r)


class KeepResults(TorchDispatchMode):
    """Forward: run each collective, wait for it, keep what it left (`_Kept`)."""

    def __init__(self, kept: dict, on_call: Callable[[str], None]) -> None:
        super().__init__()
        self.kept = kept
        self.on_call = on_call
        self.counter: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_collective(func):
            n = self.counter[func]
            self.counter[func] = n + 1
            _wait(func, out)
            self.kept[(func, n)] = _Kept(_tensors(args, kwargs), out)
            self.on_call(str(func))
        return out


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
            t.copy_(after)
        results = list(kept.results)
        for i, j in kept.handed_at.items():
            results[i] = handed[j]
        for i, made in kept.made.items():
            results[i] = made.clone()   # a second backward (retain_graph) needs it again
        return tree_unflatten(results, kept.spec)


def modes(on_call: Callable[[str], None], block_name: str
          ) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward's and the re-run's modes of one checkpointed block call, sharing what
    the forward kept. `on_call(op name)`: told of each collective the forward calls."""
    kept: dict = {}
    return KeepResults(kept, on_call), HandBack(kept, block_name)
