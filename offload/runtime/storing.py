"""Where one stored storage goes, and putting it there: step 3 of pack (hooks.py).

`Storer.store` takes one storage the hooks did not keep at once: it gives the storage its
position in the step (the round-trip plan's key), asks the placement for a decision (keep,
or tiers to try in order), hands the bytes to the first tier with room (a full tier spills
to the next; every tier full keeps them, or raises under OFFLOAD_STRICT), registers a
payload that left the device's memory with the prefetcher, and returns the storage's record
(records.py), which counts itself into the step's meter.

The core's packer does the same for a plain CPU activation (hooks.py NOTE [Move path in C]):
it reads this object's `placement`, `tiers` and `stored` (csrc/pack_moved.cpp), so those
names are the core's too.
"""
from __future__ import annotations

import logging

import torch

from ..config_parse import TIERS, knob, setting
from ..errors import TierFullError
from ..util.sizes import format_bytes
from .placement import Placement, TensorInfo
from .records import Ledger
from .tensor_meta import snapshot, snapshot_meta, snapshot_nbytes
from .timeline import Timeline

__all__ = ["Storer", "forget_warnings"]

log = logging.getLogger("offload")

# Tier lists whose "every tier is full" was said (OFFLOAD_STRICT: a one-time warning; the
# figure, `full_kept_bytes`, is every step's). offload.process.reset forgets them.
_said_full: set[tuple[str, ...]] = set()


def forget_warnings() -> None:
    """Say "every tier is full" again (offload.process.reset)."""
    _said_full.clear()


class Storer:
    """Decides where each stored storage goes and puts it there.

    Args:
        placement: Decides keep or which tiers, per stored storage.
        tiers: The step's open tiers, by name (a decision names them).
        ledger: The step's account of what saved tensors hold: its records' type and meter.
        prefetcher: Reads ahead of backward for tiers whose reloads are worth starting early.
        timeline: Where moved (and round-trip-kept) storages' pack → unpack times go.
        strict: OFFLOAD_STRICT: every tier full raises instead of keeping.
    """

    # One per step: slots make it cheaper to build (the empty step) and to read per save.
    __slots__ = ("placement", "tiers", "stats", "_meter", "_record_type", "_prefetcher",
                 "_timeline", "_strict", "stored", "_info")

    def __init__(self, placement: Placement, tiers: dict, ledger: Ledger, prefetcher,
                 timeline: Timeline, strict: bool) -> None:
        self.placement = placement
        self.tiers = tiers
        self.stats = ledger.stats
        self._meter = ledger.meter
        self._record_type = ledger.record_type
        self._prefetcher = prefetcher
        self._timeline = timeline
        self._strict = strict
        self.stored = 0  # storages decided so far: their position is the round-trip key
        # One TensorInfo, refilled per decision: the placement reads it and lets go.
        self._info = TensorInfo(0)

    def store(self, t: torch.Tensor, storage: torch.UntypedStorage, storage_nbytes: int,
              in_backward: bool, no_offload: bool, untracked: bool):
        """The record of `t`'s storage (`storage_nbytes` long), decided and placed.

        `untracked`: `t` is an alias autograd does not track (tensor_meta NOTE [Untracked
        aliases]); it is moved as a private copy of its own elements, so that no tier reads
        its storage after pack returns.
        """
        stats = self.stats
        nbytes = snapshot_nbytes(t) if untracked else storage_nbytes
        position = self.stored
        self.stored += 1
        placement = self.placement
        info = self._info
        info.nbytes, info.no_offload, info.in_backward = nbytes, no_offload, in_backward
        info.key, info.storage = (position, nbytes), storage
        decision = placement.decide(info)
        info.storage = None
        round_trip_kept = decision is placement.round_trip_decision
        if round_trip_kept:
            stats.round_trip_kept_bytes += nbytes
        elif decision is placement.backward_decision:
            stats.backward_kept_bytes += nbytes
        tier = payload = meta = None
        if decision.targets:   # not kept
            source = storage   # what the tier takes: the storage, or the alias's snapshot
            if untracked:
                copy = snapshot(t)
                meta = snapshot_meta(copy, t)
                source = copy.untyped_storage()
                nbytes = source.nbytes()
            device = source.device
            for i, name in enumerate(decision.targets):
                tier = self.tiers[name]
                payload = tier.store(source, device)
                if payload is not None:
                    if i:
                        stats.spilled_bytes += nbytes
                    break
            if payload is None:
                tier = meta = None
                self._all_full(nbytes, decision.targets)
        resident = payload is None or payload.resident
        prefetcher = None
        if not resident and tier.prefetchable(payload):   # a resident one has no reload
            prefetcher = self._prefetcher
            prefetcher.register(tier, payload)
        # The record counts the storage into the step's meter (saved bytes, kept or stored
        # in its tier): the step folds them into its Stats.
        record = self._record_type(storage, tier, payload, nbytes, resident, meta,
                                   self._meter, prefetcher)
        if payload is not None or round_trip_kept:
            # A storage the plan kept is timed too: otherwise the next plan, learning from
            # moved storages only, forgets it and moves it again (keep/move every other step).
            record.note_packed(self._timeline, position)
        return record

    def _all_full(self, nbytes: int, targets: tuple[str, ...]) -> None:
        usage = ", ".join(self.tiers[name].usage_text() for name in targets)
        config = self.placement.config   # each knob named as it was set (a keyword, a variable)
        sizes = " / ".join(knob(config.where(f"{name}_bytes"), f"{name}_bytes")
                           for name in targets)
        more = "" if set(TIERS) <= set(config.tiers) else \
            f" add a tier to {knob(config.where('tiers'), 'tiers')},"   # one not in use yet
        # strict as it was set, else in the style the tiers were set in
        strict = config.sources.get("strict") or config.where("tiers")
        on = setting(strict, "strict", True)
        off = "unset OFFLOAD_STRICT" if on.startswith("OFFLOAD_") else \
            f"pass {setting(strict, 'strict', False)}"
        # A tensor larger than every tier whole does not fit however empty they are: the
        # message says so, not that they are full.
        too_large = all(nbytes > self.tiers[name].capacity_bytes for name in targets)
        full = "no tier can hold it whole" if too_large else "every tier is full"
        if self._strict:
            raise TierFullError(
                f"offload: {full} ({usage}) and {on}, so a "
                f"{format_bytes(nbytes)} activation cannot be placed (raise {sizes},{more} or "
                f"{off} to keep such tensors on the device)")
        self.stats.full_kept_bytes += nbytes
        if (targets, too_large) not in _said_full:   # once per process and tier list
            _said_full.add((targets, too_large))
            log.warning("offload: %s (%s); a %s activation stays on the "
                        "device, and so will every later one that does not fit (smaller ones "
                        "still move while there is room; ctx.stats.full_kept_bytes counts "
                        "what stayed). Raise %s%s; %s makes this an error",
                        full, usage, format_bytes(nbytes), sizes,
                        f" or{more.rstrip(',')}" if more else "", on)

