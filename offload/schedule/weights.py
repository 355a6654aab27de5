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
Likewise a weight's `requires_grad` flipped since the call (a GAN step that freezes the
discriminator for the generator's loss and unfreezes it before the backward) is flipped
back for the re-run only: a re-run with the new flag builds another graph than the
forward's, saves other tensors, and checkpoint hands the backward the wrong ones (silently
where their shapes agree) or raises its CheckpointError.

A weight changed in place between the forward and the re-run (an optimizer step between
two backwards of a retained graph, a bias set before backward) would be re-run with its
new values, as under torch's checkpoint: another function than the forward ran, silently,
where plain training computes from the forward's values or raises its in-place error for a
weight an op saved. So the call
notes the version counters of those weights and of the parameters handed to it as
arguments (`block(x, self.shift)`) when its forward returns, and a re-run whose weights
moved since raises autograd's in-place error, naming the weight. Not checked:
- a weight the block's forward itself changes in place. An embedding with `max_norm`
  renormalises the rows it looks up, in every call: its re-run runs without `max_norm`
  and reads the rows as its forward renormalised them. Renormalising them again is not the
  identity in float32 (the weight drifted by 1e-7 from plain training's, and the gradients
  with it), and it would change the weight once more. Rows a later call of the same
  embedding in the step renormalises again are read as that call left them (their
  gradients may differ in the last bits), and a block that holds such an embedding without
  looking it up is not checked for it either. Any other weight its forward changes is
  read by the re-run as it is then and changed again, as under checkpoint: said once (a
  value a forward updates belongs in a buffer, which buffers.py sets back);
- a weight with a post-accumulate-grad hook, or one an optimizer in backward steps
  (`_apply_optimizer_in_backward`). Its grad can be complete before its block's re-run
  only when no op after it in the block saved anything (a bias added last), and then the
  re-run computes nothing backward still needs from it (the recipe trains as in plain
  training: tests/test_model_state.py). A weight stepped in between two backwards of a
  retained graph, which plain training refuses, is re-run with its new values there;
- a change through `.data`, which moves no counter, as for autograd, and a weight the
  block reaches otherwise (a module-level global, a plain list).
Cost: a look at each module's parameters per call and per re-run, and their version
counters twice per call and once per re-run (each ~0.9 us for a transformer layer's
twelve, timeit on the 2-core dev VM); nothing is copied.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
import torch.nn as nn

from .changed_buffers import changed_in_place_error

__all__ = ["guard_weights", "forget_messages"]

log = logging.getLogger("offload")


def guard_weights(modules: list[nn.Module], fn: Callable, handed: tuple = (),
                  block: nn.Module | None = None) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the parameter
    objects of `modules` (each with its submodules) as they were at the forward put
    back for its re-runs, and a re-run refused when one of them, or of the parameters
    `handed` to the call as arguments, was changed in place since (NOTE [Weights in a
    re-run]). `block`: the one of `modules` that is the block (for messages)."""
    calls = 0
    noted: list[tuple[dict, dict]] = []
    weights: list[torch.Tensor] = []   # the noted parameter objects and `handed`, flat
    versions: list[int] = []           # theirs when the forward returned
    needs_grad: list[bool] = []        # their requires_grad at the call
    rewritten: set[int] = set()        # indices of those the forward itself changed
    renorming: list[nn.Module] = []    # embeddings whose max_norm did it

    def run(*args) -> Any:
        nonlocal calls, versions
        calls += 1
        if calls == 1:
            seen: set[int] = set()
            for root in modules:
                for module, sharded in _modules(root):
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    slots = module._parameters
                    if isinstance(slots, dict) and slots:   # (a ScriptModule's is not)
                        if not sharded:   # NOTE [Sharded weights]
                            noted.append((slots, dict(slots)))
                        weights.extend(w for w in slots.values() if w is not None)
            weights.extend(handed)
            needs_grad[:] = [w.requires_grad for w in weights]
            before = [w._version for w in weights]
            out = fn(*args)
            versions = [w._version for w in weights]
            if versions != before:
                rewritten.update(i for i, (a, b) in enumerate(zip(before, versions)) if a != b)
                renorming.extend(_rewritten_by_forward(modules, [weights[i] for i in rewritten],
                                                       block))
            return out
        if [w._version for w in weights] != versions:
            _check_versions(modules, weights, versions, rewritten, block)
        swapped = [(params, name, params.get(name)) for params, then in noted
                   for name, weight in then.items() if params.get(name) is not weight]
        flipped = list({id(w): w for w, then in zip(weights, needs_grad)   # (a tied weight
                        if w.requires_grad != then}.values())               # is listed twice)
        if not swapped and not renorming and not flipped:
            return fn(*args)
        by_params = {id(params): then for params, then in noted}
        for params, name, _ in swapped:
            params[name] = by_params[id(params)][name]
        norms = [module.max_norm for module in renorming]
        for module in renorming:
            module.max_norm = None
        for w in flipped:   # (leaves: a non-leaf's flag cannot change)
            w.requires_grad_(not w.requires_grad)
        try:
            return fn(*args)
        finally:
            for w in flipped:
                w.requires_grad_(not w.requires_grad)
            for params, name, now in swapped:
                if now is None:
                    params.pop(name, None)
                else:
                    params[name] = now
            for module, norm in zip(renorming, norms):
                module.max_norm = norm

    return run


def _modules(root: nn.Module):
    """(module, whether FSDP2 shards its parameters) for `root` and its submodules.

    NOTE [Sharded weights] FSDP2 (`fully_shard`) swaps the parameter objects of the modules
    it manages itself: sharded DTensors between uses, unsharded tensors for the forward and
    again for the backward, a re-run included. A module inside a block sharded on its own
    (`fully_shard(block.mlp)`, MoE experts) still holds its DTensors when the block is
    called, and the unsharded ones when the block re-runs in backward: putting the DTensors
    back for the re-run, as for functional_call, handed the linear a DTensor ("mixed
    torch.Tensor and DTensor") under `recompute`, and failed `auto`'s checkpoint trial. Such
    slots are FSDP's to fill, as under torch's checkpoint; their weights are still checked
    for in-place changes and `requires_grad` flips."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded_type = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if sharded_type is None:   # FSDP2 never imported: no module is sharded by it
        for module in root.modules():
            yield module, False
        return
    stack = [(root, False)]
    while stack:
        module, under = stack.pop()
        sharded = under or isinstance(module, sharded_type)
        yield module, sharded
        stack.extend((child, sharded) for child in reversed(list(module.children())))


def _check_versions(modules: list[nn.Module], weights: list[torch.Tensor], versions: list[int],
                    rewritten: set[int], block: nn.Module | None) -> None:
    """Raise autograd's in-place error for the first weight whose version moved since the
    forward returned, unless the forward itself changed it, it is an embedding's that
    renormalises it (`max_norm`: another call of it in the step did), or an optimizer steps
    it in backward (NOTE [Weights in a re-run])."""
    renormed: dict | None = None   # weight id -> its embedding
    for i, (weight, then) in enumerate(zip(weights, versions)):
        if weight._version == then or i in rewritten or _stepped_in_backward(weight):
            continue
        if renormed is None:
            renormed = {id(m.weight): m for m in _renorming(modules)}
        if id(weight) not in renormed:
            raise _changed_error(modules, weight, then, block)


def _renorming(modules: list[nn.Module]) -> list[nn.Module]:
    """The embeddings among `modules` (each with its submodules) that have a `max_norm`."""
    return [m for root in modules for m in root.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]


# (block type, weight name) whose "changed by its own forward" was said once.
_said_rewritten: set[tuple[str, str]] = set()


def forget_messages() -> None:
    """Say the messages again (offload.process.reset)."""
    _said_rewritten.clear()


def _rewritten_by_forward(modules: list[nn.Module], changed: list[torch.Tensor],
                          block: nn.Module | None) -> list[nn.Module]:
    """The embeddings among `modules` with a `max_norm` whose weight is in `changed` (their
    re-run runs without it); any other weight in `changed` is said once: the re-run reads
    it as it is then and changes it again."""
    ids = {id(w) for w in changed}
    found = {id(m.weight): m for m in _renorming(modules) if id(m.weight) in ids}
    for weight in changed:
        if id(weight) in found:
            continue
        name = _name(modules, weight, block)
        key = (type(block).__name__, name)
        if key not in _said_rewritten:
            _said_rewritten.add(key)
            log.warning("offload: %s is changed in place by the forward of the block that "
                        "holds it (a %s): its re-run in backward reads the changed values and "
                        "changes it again, as under torch's checkpoint. A value a forward "
                        "updates belongs in a buffer (register_buffer), which a re-run sets "
                        "back; or leave this block out of blocks=", name,
                        type(block).__name__ if block is not None else "block")
    return list({id(m): m for m in found.values()}.values())


def _stepped_in_backward(weight: torch.Tensor) -> bool:
    return bool(weight._post_accumulate_grad_hooks) or hasattr(weight, "_in_backward_optimizers")


def _name(modules: list[nn.Module], weight: torch.Tensor, block: nn.Module | None) -> str:
    """How a message names a weight: its path in the block or in the module handed in."""
    for root in modules:
        for path, p in root.named_parameters(remove_duplicate=False):
            if p is weight:
                return (f"`{path}` of the block (a {type(root).__name__})" if root is block
                        else f"`{path}` of a {type(root).__name__} handed to the block")
    return f"a parameter handed to the block ({list(weight.shape)})"


def _changed_error(modules: list[nn.Module], weight: torch.Tensor, then: int,
                   block: nn.Module | None) -> RuntimeError:
    return changed_in_place_error(
        weight, then, f"{_name(modules, weight, block)}, read by",
        "the re-run would compute the gradient from the new values, where plain autograd uses "
        "those the forward ran with (or raises this error). Change weights after the backward "
        "(an optimizer step between two backwards of a retained graph steps them in between), "
        "or run such steps with policy='offload', which keeps the forward's values.")
