"""A block call's arguments taken apart into leaves, and rebuilt from leaves.

NOTE [Arguments as at the call] A re-run must see a block's arguments as they were at its
call (recompute.py `checkpoint_block`), though the caller or later blocks may have changed
the containers since: a dict of memories whose entry later blocks replace, a list they
append to, a dataclass whose field they set (`mem.h = out`). So the call's arguments are
taken apart into leaves at the call, and the re-run gets a copy rebuilt from those leaves.
Containers are what torch's pytree knows (tuples, lists, dicts, named tuples, types
registered with it: Hugging Face's ModelOutput) and, beyond it, dataclass instances: a
rebuilt one is a shallow copy (`copy.copy`, taken at the call: an attribute that is not a
field is as it was then) whose fields are set to their rebuilt values.
Other objects are leaves: the re-run gets the object itself, as it is then. An object met
again inside itself (a dataclass holding itself) is a leaf there.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["flatten_call"]


def _is_dataclass_instance(x: Any) -> bool:
    return hasattr(type(x), "__dataclass_fields__") and not isinstance(x, type)


def _flatten(obj: Any, inside: frozenset) -> tuple[list, Callable[[list], Any]]:
    leaves, spec = tree_flatten(obj)
    if not any(map(_is_dataclass_instance, leaves)):   # the common call: pytree alone
        return leaves, lambda new: tree_unflatten(new, spec)
    out: list = []
    parts: list[tuple[int, Callable[[list], Any] | None]] = []
    for leaf in leaves:
        if _is_dataclass_instance(leaf) and id(leaf) not in inside:
            names = [f.name for f in dataclasses.fields(leaf) if hasattr(leaf, f.name)]
            sub, rebuild = _flatten([getattr(leaf, name) for name in names],
                                    inside | {id(leaf)})
            parts.append((len(sub), _dataclass_builder(leaf, names, rebuild)))
            out.extend(sub)
        else:
            parts.append((1, None))
            out.append(leaf)

    def rebuild(new: list) -> Any:
        at, rebuilt = 0, []
        for n, build in parts:
            rebuilt.append(new[at] if build is None else build(new[at:at + n]))
            at += n
        return tree_unflatten(rebuilt, spec)

    return out, rebuild


def _dataclass_builder(original: Any, names: list[str],
                       rebuild: Callable[[list], Any]) -> Callable[[list], Any]:
    # The shallow copy is taken now, at the call: what is not a field (an attribute set in
    # `__post_init__` or later: a gain the block scales by, then updates) is as at the call.
    # Its fields are cleared (the leaves hold their values): the template holds no input
    # tensor until backward (recompute.py `checkpoint_block`).
    template = copy.copy(original)
    for name in names:
        object.__setattr__(template, name, None)

    def build(leaves: list) -> Any:
        new = copy.copy(template)
        for name, value in zip(names, rebuild(leaves)):
            object.__setattr__(new, name, value)   # frozen dataclasses too
        return new
    return build


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple]]:
    """The leaves of `(args, kwargs)` in order (NOTE [Arguments as at the call]) and a
    function rebuilding `(args, kwargs)` as new containers from a list of leaves."""
    return _flatten((args, kwargs), frozenset())
