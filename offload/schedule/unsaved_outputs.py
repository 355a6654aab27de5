"""What a stored op holds beyond the step's saves: the outputs of a block's ops that no save
of the step used.

NOTE [Unsaved outputs] Per-op recompute stores an op's outputs all together, with one
decision per op (stored_ops.py), so that the re-run can hand them back: also those no save
refers to (BatchNorm's normalised output when the next op reads it through a copy; an
output of a tuple op that nothing saves). The plan priced only the saves: a BatchNorm block
under a 239 KiB budget kept 263.5 KiB. So the profile counts, per op of each block call, the
bytes of the storages it made that no save of the step used, in its block or after it (the
next block's input, a loss outside the blocks). A storage saved anywhere is counted by that
save's record already, so once. The plan counts these bytes (`ItemRecord.unsaved`) only
where it stores the op: a block run as it is frees them as a plain forward does, and an op
that re-runs holds nothing. Rules:

1. A storage counts at its block's exit unless a save in the block used it, and comes off
   again when a later save uses it (the storage still alive: the same object, not one that
   took a freed one's id).
2. A storage freed inside its block counts too: stored, it would outlive the block.
3. Not seen: a save below OFFLOAD_MIN_BYTES outside the blocks (the hooks keep it without
   asking the placement), so an output saved only there counts as unsaved: more, never
   less, than is held.
4. Per op, the outputs at or above OFFLOAD_MIN_BYTES may move with the op; those below stay
   (the hooks keep small tensors at once), each its own record.
5. A later save of an op's output (`ItemRecord.made_by`) shares the op's fate where the plan
   stores the op: the op packs the storage first, and a storage is stored once (one record),
   so its decision is the op's (search.py `_assemble`). Else a post-norm block's stored
   LayerNorm moved its output while the plan counted the next block's input kept.
"""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["UnsavedOutputs"]


class UnsavedOutputs:
    """Follows the storages a profiled step's block ops make (`maker`: the profile's
    producer of a storage) and the saves that use them."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        # The current block's storages: id -> [weak ref, op record, bytes, saved]
        self._block: dict[int, list] = {}
        self._freed: list[tuple[Any, int]] = []   # made and freed unsaved (Rule 2)
        # Unsaved at their block's exit and alive: id -> (weak ref, block, op id, bytes, or
        # None once a later save used it)
        self._later: dict[int, tuple] = {}

    def made(self, storage: Any, record: Any) -> None:
        key = id(storage)
        old = self._block.get(key)
        if old is not None and old[0]() is None and not old[3]:
            self._freed.append((old[1], old[2]))   # Rule 2: its id went to a new storage
        self._block[key] = [weakref.ref(storage), record, storage.nbytes(), False]

    def maker(self, storage: Any) -> Any:
        """The op record that made `storage` in the current block, or None."""
        entry = self._block.get(id(storage))
        return entry[1] if entry is not None and entry[0]() is storage else None

    def saved(self, storage: Any) -> tuple | None:
        """A save of the step used `storage` (in a block or outside); the (block index, op
        id) that made it in an earlier block (Rule 5), else None."""
        key = id(storage)
        entry = self._block.get(key)
        if entry is not None and entry[0]() is storage:
            entry[3] = True
            return None
        later = self._later.get(key)
        if later is None or later[0]() is not storage:
            return None
        if later[3] is not None:   # Rule 1: the first later save takes it off
            _add(later[1], later[2], later[3], self.min_bytes, -1)
            self._later[key] = (*later[:3], None)
        return later[1].index, later[2]

    def block_done(self, block: Any) -> None:
        """The block's call returned: what none of its saves used counts (Rule 1)."""
        for record, nbytes in self._freed:
            _add(block, record.op_id, nbytes, self.min_bytes, 1)
        for key, (ref, record, nbytes, saved) in self._block.items():
            if saved:
                continue
            _add(block, record.op_id, nbytes, self.min_bytes, 1)
            if ref() is not None:
                self._later[key] = (ref, block, record.op_id, nbytes)
        self._block.clear()
        self._freed.clear()

    def finish(self) -> None:
        self._later.clear()


def _add(block: Any, op_id: tuple, nbytes: int, min_bytes: int, sign: int) -> None:
    key = (op_id, nbytes < min_bytes)   # Rule 4
    block.unsaved[key] = block.unsaved.get(key, 0) + sign * nbytes
