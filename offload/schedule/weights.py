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
two backwards of a retained graph, a weight average written into the model before
backward) would be re-run with its new values, as under torch's checkpoint: another
function than the forward ran, silently, where plain training computes from the forward's
values or raises its in-place error for a weight an op saved. So the call also notes each
weight's version counter when its forward returns, and a re-run whose weights moved since
raises autograd's in-place error, naming the weight. Not checked:
- a weight the block's forward itself changes in place (an embedding with `max_norm`
  renormalises the rows it looks up, in every call). An embedding's re-run runs without
  its `max_norm`: the rows its forward renormalised are read as they are. Renormalising
  them again is not the identity in float32 (the weight drifted by 1e-7 from plain
  training's, and the gradients with it), and it would change the weight once more. Rows
  a later call of the same embedding in the step renormalises again are read as that call
  left them (their gradients may differ in the last bits);
- a weight that its own post-accumulate-grad hook or an optimizer in backward
  (`_apply_optimizer_in_backward`) steps. Its grad can be complete before its block's
  re-run only when no op after it in the block saved anything (a bias added last), and
  then the re-run computes nothing backward still needs from it (the recipe trains as in
  plain training: tests/test_model_state.py);
- a change through `.data`, which moves no counter, as for autograd.
Cost: a look at each module's parameters per call and per re-run, and their version
counters twice per call and once per re-run (each ~0.9 us for a transformer layer's
twelve, timeit on the 2-core dev VM); nothing is copied.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..runtime.version_check import version_error

__all__ = ["guard_weights"]


def guard_weights(modules: list[nn.Module], fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the parameter
    objects of `modules` (each with its submodules) as they were at the forward put
    back for its re-runs, and a re-run refused when one of them was changed in place since
    (NOTE [Weights in a re-run])."""
    calls = 0
    noted: list[tuple[dict, dict]] = []
    weights: list[torch.Tensor] = []   # the noted parameter objects, flat
    versions: list[int] = []           # theirs when the forward returned
    rewritten: set[int] = set()        # indices of those the forward itself changed
    renorming: list[nn.Module] = []    # embeddings whose max_norm did it

    def run(*args) -> Any:
        nonlocal calls, versions
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
                        weights.extend(w for w in slots.values() if w is not None)
            before = [w._version for w in weights]
            out = fn(*args)
            versions = [w._version for w in weights]
            if versions != before:
                rewritten.update(i for i, (a, b) in enumerate(zip(before, versions)) if a != b)
                renorming.extend(_renorming(modules, [weights[i] for i in rewritten]))
            return out
        if [w._version for w in weights] != versions:
            _check_versions(modules, weights, versions, rewritten)
        swapped = [(params, name, params.get(name)) for params, then in noted
                   for name, weight in then.items() if params.get(name) is not weight]
        if not swapped and not renorming:
            return fn(*args)
        by_params = {id(params): then for params, then in noted}
        for params, name, _ in swapped:
            params[name] = by_params[id(params)][name]
        norms = [module.max_norm for module in renorming]
        for module in renorming:
            module.max_norm = None
        try:
            return fn(*args)
        finally:
            for params, name, now in swapped:
                if now is None:
                    params.pop(name, None)
                else:
                    params[name] = now
            for module, norm in zip(renorming, norms):
                module.max_norm = norm

    return run


def _check_versions(modules: list[nn.Module], weights: list[torch.Tensor],
                    versions: list[int], rewritten: set[int]) -> None:
    """Raise autograd's in-place error for the first weight whose version moved since the
    forward returned, unless the forward itself changed it or an optimizer steps it in
    backward (NOTE [Weights in a re-run])."""
    for i, (weight, then) in enumerate(zip(weights, versions)):
        if weight._version != then and i not in rewritten and not _stepped_in_backward(weight):
            raise _changed_error(modules, weight, then)


def _renorming(modules: list[nn.Module], changed: list[torch.Tensor]) -> list[nn.Module]:
    """The embeddings among `modules` with a `max_norm` whose weight is in `changed`."""
    ids = {id(w) for w in changed}
    found = {id(m): m for root in modules for m in root.modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
             and id(m.weight) in ids}
    return list(found.values())


def _stepped_in_backward(weight: torch.Tensor) -> bool:
    return bool(weight._post_accumulate_grad_hooks) or hasattr(weight, "_in_backward_optimizers")


def _changed_error(modules: list[nn.Module], weight: torch.Tensor, then: int) -> RuntimeError:
    name = next((f"`{path}` of the {type(root).__name__} block" for root in modules
                 for path, p in root.named_parameters(remove_duplicate=False) if p is weight),
                "a weight")
    error = version_error(weight.dtype, weight.device, weight.shape, None, then, weight._version,
                          weight.layout)
    return RuntimeError(
        f"{error} offload: it is {name}, a weight of a block re-run in backward (`recompute`, "
        f"or `auto` recomputing its ops), changed in place after the block's forward: the "
        f"re-run would compute the gradient from the new values, where plain autograd uses "
        f"those the forward ran with (or raises this error). Change weights after the "
        f"backward (an optimizer step between two backwards of a retained graph steps them "
        f"in between), or run such steps with policy='offload', which keeps the forward's "
        f"values.")
