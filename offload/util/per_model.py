"""State kept per model across steps, in one registry that dies with the model.

A training loop often builds a fresh `offload.activations(model=...)` every step; what one
step learns for the next (the round-trip plan, `auto`'s sessions and plans, the buffers a
block's re-run must not touch twice) is kept here, keyed by the model object (weakly: it
dies with the model) and by what it is for. `offload.process.reset()` clears it.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable

__all__ = ["state_for", "clear"]

_lock = threading.Lock()
_by_model: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def state_for(model: Any, purpose: Hashable, make: Callable[[], Any]) -> Any:
    """The state `make()` made for (`model`, `purpose`) the first time it was asked for."""
    with _lock:
        states = _by_model.get(model)
        if states is None:
            states = _by_model[model] = {}
        state = states.get(purpose)
        if state is None:
            state = states[purpose] = make()
        return state


def clear() -> None:
    """Forget every model's state (tests, `offload.process.reset()`)."""
    with _lock:
        _by_model.clear()
