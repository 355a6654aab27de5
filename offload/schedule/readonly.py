"""`ReadOnlyDict`: the mappings of an immutable plan (plan.py, costs.py `Prediction`).

A dict (lookups at dict speed on the hot path, json, pickle and copy work as for a dict)
whose mutating methods raise, so a plan shared across shape classes and threads cannot be
changed through one of its tables.
"""
from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ReadOnlyDict"]


class ReadOnlyDict(dict):
    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a plan's tables are read-only: make a new plan (search.make_plan) "
                        "instead of changing this one")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:
        return (ReadOnlyDict, (dict(self),))

    def __copy__(self) -> "ReadOnlyDict":
        return self

    def __deepcopy__(self, memo: dict) -> "ReadOnlyDict":
        import copy

        return ReadOnlyDict(copy.deepcopy(dict(self), memo))
