"""The weights a block's forward ran with, put back for its re-run.

NOTE [Weights in a re-run] `recompute` and `auto` re-run blocks in backward. A forward may
run with other weights than the module's own: `torch.func.functional_call(model, fast,
x)` (MAML, hypernetworks) swaps each module's parameters (and buffers, given as
`(params, buffers)`) for the given tensors and puts the module's own back when it
returns, before the backward. The re-run would compute with the module's own, another
function than the forward ran: silently wrong gradients (as under torch's checkpoint).
So a call notes the parameter objects of the modules it guards (the block's and those
handed to it as arguments), and its re-run puts back, for itself only, each one that was
replaced since; afterwards the module gets what it had. Buffers are buffers.py's: its
re-run sets every buffer slot to what it held at the call, functional_call's included.

A weight changed in place between the forward and the re-run (an optimizer step between
two backwards of a retained graph) is re-run with its new values, as under torch's
checkpoint: the checkpointed block saved no weight, so autograd has nothing to check, where
plain training raises its in-place error for a weight an op saved. Not checked here: a
weight stepped during the backward (an optimizer in backward, a post-accumulate-grad hook)
changes before later re-runs and is then no input of any of them, and an embedding with
max_norm renormalises its weight in place at every call, so a version check would raise
where plain training runs. Cost: a look at each module's parameters per call and per
re-run; nothing is copied.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

__all__ = ["guard_weights"]


def guard_weights(modules: list[nn.Module], fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the parameter
    objects of `modules` (each with its submodules) as they were at the forward put
    back for its re-runs (NOTE [Weights in a re-run])."""
    calls = 0
    noted: list[tuple[dict, dict]] = []

    def run(*args) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            seen: set[int] = set()
            for root in modules:
                for module in root.modules():
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    slots = module._parameters
                    if isinstance(slots, dict) and slots:   # (a ScriptModule's is not)
                        noted.append((slots, dict(slots)))
            return fn(*args)
        swapped = [(params, name, params.get(name)) for params, then in noted
                   for name, weight in then.items() if params.get(name) is not weight]
        if not swapped:
            return fn(*args)
        by_params = {id(params): then for params, then in noted}
        for params, name, _ in swapped:
            params[name] = by_params[id(params)][name]
        try:
            return fn(*args)
        finally:
            for params, name, now in swapped:
                if now is None:
                    params.pop(name, None)
                else:
                    params[name] = now

    return run
