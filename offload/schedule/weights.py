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
two backwards of a retained graph) raises autograd's in-place error, as plain training
does: the call notes each weight's version as it returns, and the re-run checks it. The checkpointed
block saved no weight for autograd to check, and a re-run with the changed values would
compute another function than the forward ran (silently, under torch's checkpoint too).
Plain autograd checks only the weights an op saved; a re-run uses all of them, so a
changed weight no op saved (a bias added) raises here too. Cost: a look at each module's
parameters and their versions per call and per re-run; nothing is copied.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..runtime.saved_handles import kept_version_error

__all__ = ["guard_weights"]


def guard_weights(modules: list[nn.Module], fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the parameter
    objects of `modules` (each with its submodules) as they were at the forward put
    back for its re-runs (NOTE [Weights in a re-run])."""
    calls = 0
    noted: list[tuple[dict, dict]] = []
    versions: list[tuple[torch.Tensor, int]] = []

    def note_versions() -> None:
        # As the call (or re-run) left them: a forward's own in-place change of a weight
        # (a clamp under no_grad) is the forward's, not a change since.
        versions[:] = [(w, w._version) for _, then in noted for w in then.values()
                       if isinstance(w, torch.Tensor)]

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
            try:
                return fn(*args)
            finally:
                note_versions()
        for weight, version in versions:
            if weight._version != version:
                raise kept_version_error(weight, version, None, 0)
        swapped = [(params, name, params.get(name)) for params, then in noted
                   for name, weight in then.items() if params.get(name) is not weight]
        if not swapped:
            try:
                return fn(*args)
            finally:
                note_versions()
        by_params = {id(params): then for params, then in noted}
        for params, name, _ in swapped:
            params[name] = by_params[id(params)][name]
        try:
            return fn(*args)
        finally:
            note_versions()
            for params, name, now in swapped:
                if now is None:
                    params.pop(name, None)
                else:
                    params[name] = now

    return run
