"""The scheduler's side of one `offload.activations()` context: `start_session` picks the
policy's session (session_base.py says what the context asks of it).

`keep` / `offload`: `Session`, which does nothing. `recompute`: recompute_session.py (every
block checkpointed). `auto`: auto_session.py (a plan per shape class, per-op recompute,
trials), its plans kept across contexts in plan_cache.py.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from .auto_session import AutoSession
from .blocks import locate_blocks, lone_layer_hint
from .plan_cache import cache_for
from .recompute_session import RecomputeSession
from .session_base import Session

# `Session` is named here too: the context builds one for a disabled context.
__all__ = ["Session", "start_session", "refreshed"]

log = logging.getLogger("offload")


def _no_blocks(model: torch.nn.Module | None, blocks: Any) -> str:
    """Why `recompute` found no block, and what to pass, for what was passed."""
    if callable(blocks) and not isinstance(blocks, torch.nn.Module):
        return ("blocks=<predicate> matched no module of model= (it is called with every "
                "submodule: check it returns True for your layers, e.g. "
                "blocks=lambda m: isinstance(m, MyLayer))")
    if blocks is not None:
        return "blocks= is empty (give the layers to checkpoint, or a predicate)"
    if model is None:
        return ("found no blocks to checkpoint: pass model= (its blocks are the members of an "
                "nn.ModuleList / nn.Sequential of two or more layers of one class), or "
                "blocks=[...] / blocks=lambda m: isinstance(m, MyLayer)")
    return ("found no blocks to checkpoint in the model (blocks are the members of an "
            "nn.ModuleList / nn.Sequential of two or more layers of one class); "
            + (lone_layer_hint(model) or
               "pass blocks=[...] / blocks=lambda m: isinstance(m, MyLayer)"))


def start_session(config: Config, model: torch.nn.Module | None, blocks: Any,
                  located: tuple | None = None) -> Session:
    """The session for `config.policy`; raises ConfigError when `recompute` finds no block.
    `located`: `locate_blocks(model, blocks)`, when the caller has it."""
    if config.policy not in ("recompute", "auto"):
        return Session(config)
    found, watch = located or locate_blocks(model, blocks)
    if config.policy == "recompute":
        if not found:
            raise ConfigError(f"{config.where('policy')}: {_no_blocks(model, blocks)}")
        session = RecomputeSession(config, found)
    else:
        session = AutoSession(config, cache_for(model, config, found), found, model)
    session.watch = watch   # blocks added later (`refreshed`)
    return session


def refreshed(session: Session, config: Config, model: torch.nn.Module | None,
              blocks: Any) -> Session:
    """The session the next step runs with (the context asks at each entry, never while
    active): `session`, or a new one when the containers its blocks were found in changed
    since (stack_watch.py: a block appended, removed or replaced, or a container), so that
    the blocks found now run the policy's way (`auto` then profiles them). When none is found now (a
    module of another class appended to the stack), the blocks found before stay."""
    watch = session.watch
    if not watch.changed():
        return session
    try:
        located = locate_blocks(model, blocks)
    except ConfigError:
        located = ([], None)
    if not located[0]:
        log.warning("offload: %s: the model's blocks changed since they were found, and none "
                    "is found now; %s (pass blocks= to choose them)", config.policy,
                    _still_run(session.blocks, model))
        watch.accept()
        return session
    log.info("offload: %s: the model's blocks changed since they were found (%d now); found "
             "again", config.policy, len(located[0]))
    return start_session(config, model, blocks, located)


def _still_run(found: list, model: torch.nn.Module | None) -> str:
    """What runs as before: the blocks found before that the model still holds (one
    replaced or removed is never called again; its replacement runs as it is)."""
    held = {id(m) for m in model.modules()} if model is not None else None
    gone = sum(1 for block in found if id(block) not in held) if held is not None else 0
    if not gone:
        return f"the {len(found)} found before run as before"
    return (f"the {len(found) - gone} of the {len(found)} found before that the model still "
            f"holds run as before ({gone} replaced or removed; what replaced them runs as it "
            "is)")
