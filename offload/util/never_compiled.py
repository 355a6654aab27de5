"""NOTE [Never compiled] torch.compile must run the hooks' Python as Python.

Autograd calls the saved-tensor hooks, and the core calls back into the runtime (a tier's
`fetch` / `release`, `records.load`, the backward's marks, the version errors' builders, the
step's Stats and trace), from inside whatever op saves or unpacks a tensor. Under
`torch.compile`, a part dynamo does not put in a graph (an `nn.GRU` / `nn.LSTM`, a graph
break's skipped function) runs eagerly *with dynamo's frame evaluator still installed*:
every Python frame it reaches that does not live in torch is compiled as user code. Our
hooks then ran as a traced frame, once per save, with the saved tensor symbolic after the
first few shapes: `owner.nbytes` raised "Cannot call numel() on tensor with symbolic
sizes/strides" (a GRU inside `offload.activations()`), and had it not, each save would have
been a dynamo trace.

`never_compiled` marks a function's code object, or every function of a class, so that
dynamo's frame evaluator skips that frame *and everything it calls*: the same action
`torch.compiler.disable` takes, set once on the code instead of a wrapper per call (a
`disable`d function costs ~0.4 us a call, measured with timeit on the dev VM; a marked one
costs nothing when no compiled code runs). It changes nothing when dynamo traces a compiled
function that calls one of ours: inlining reads dynamo's file rules, not these marks.

The mark lives in torch's C module (`torch._C._dynamo.eval_frame`, loaded with torch:
importing dynamo itself costs ~1 s), under private names; on a torch without them it marks
nothing, and tests/test_compile.py's RNN test says so.
"""
from __future__ import annotations

import sys
import types
from typing import Any, TypeVar

__all__ = ["never_compiled"]

Owner = TypeVar("Owner")


def _skip_strategy() -> Any:
    try:
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 set_code_exec_strategy)
    except ImportError:   # a torch built without dynamo, or one that renamed these
        return None
    # Skip this frame, and every frame it calls (the recursive action).
    return set_code_exec_strategy, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


_SKIP = _skip_strategy()


def _functions(owner: Any):
    """The plain functions `owner` runs: itself, or a class's methods, static and class
    methods and properties' accessors (its own; a subclass is marked on its own). Only code
    compiled from the class's own file, or generated for it (`<string>`: a dataclass's
    `__init__`, `__eq__`): a wrapper another module made (dataclasses' `__repr__` guard) is
    one code object shared with every class that module made, the user's too."""
    if isinstance(owner, types.FunctionType):
        yield owner
        return
    if not isinstance(owner, type):
        raise TypeError(f"never_compiled: expected a function or a class, got {owner!r}")
    home = getattr(sys.modules.get(owner.__module__), "__file__", None)
    for value in vars(owner).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        found = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
        # By the code's file: `functools.wraps` gives a wrapper its wrapped one's module.
        yield from (f for f in found if isinstance(f, types.FunctionType)
                    and f.__code__.co_filename in (home, "<string>"))


def never_compiled(owner: Owner) -> Owner:
    """Mark `owner` (a function, or every function of a class) never to be compiled by
    torch.compile, nor anything it calls (NOTE [Never compiled]). Returns `owner` itself, so
    it serves as a decorator."""
    functions = list(_functions(owner))
    if _SKIP is not None:
        set_strategy, strategy = _SKIP
        for function in functions:
            set_strategy(function.__code__, strategy)
    return owner


def marks_available() -> bool:
    """Whether this torch lets `never_compiled` mark anything."""
    return _SKIP is not None
