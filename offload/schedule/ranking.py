"""Per block type: which ops may be recomputed, in the order the search tries them.

The ops whose outputs backward keeps are ranked by recompute time per byte freed, cheapest
first. Ops whose output cannot be stored (a dropout mask written in place, stored_ops.py
Rule 1) come first whatever they cost: any per-op recompute of the block re-runs them. Each
prefix of the ranking is one candidate of the search (search.py); the empty prefix runs the
block as it is ("plain").
"""
from __future__ import annotations

from dataclasses import dataclass

from .profile import ItemRecord, OpRecord, Profile

__all__ = ["TypeInfo", "type_infos", "candidates"]


@dataclass(frozen=True)
class TypeInfo:
    """One block type as the search sees it."""

    type_key: tuple
    name: str
    instances: list[int]
    ops: list[OpRecord]
    saved: dict                  # op id -> saved bytes per instance (max over instances)
    ranking: list[tuple]         # op ids, recompute order
    forced: int                  # how many of the ranking's first entries are forced
    rerunnable: bool = True      # no instance's inputs changed in place after its call,
    #                              nor did one call a collective (plan_cache.py NOTE [Blocks
    #                              run alike on every rank]) or read a save twice (profile.py
    #                              NOTE [Reads a re-run refuses])


def type_infos(profile: Profile, items: list[ItemRecord]) -> list[TypeInfo]:
    """The profile's block types (profile.py NOTE [Op identity]), each with its ranking."""
    by_block: dict[int, list[ItemRecord]] = {}
    for it in items:
        if it.block is not None:
            by_block.setdefault(it.block, []).append(it)
    infos = []
    for type_key, records in profile.block_types().items():
        ops = profile.op_table(type_key)
        saved: dict[tuple, int] = {}
        held: dict[tuple, int] = {}   # + what it made that nothing saved: held if stored
        for b in records:
            per: dict[tuple, int] = {}
            also: dict[tuple, int] = {}
            again: dict[tuple, int] = {}   # saved again after the block: a re-run frees none
            for it in by_block.get(b.index, []):
                if it.producer is not None and not it.small:   # (small: never a decision)
                    into = also if it.unsaved else per   # NOTE [Unsaved outputs]
                    into[it.producer] = into.get(it.producer, 0) + it.nbytes
                    if it.saved_again:   # placement.py NOTE [Saved again after its block]
                        again[it.producer] = again.get(it.producer, 0) + it.nbytes
            for op_id, nbytes in per.items():
                saved[op_id] = max(saved.get(op_id, 0), nbytes)
                held[op_id] = max(held.get(op_id, 0),
                                  nbytes - again.get(op_id, 0) + also.get(op_id, 0))
        by_id = {o.op_id: o for o in ops}
        producers = [o for o in saved if o in by_id]
        forced = sorted((o for o in producers if by_id[o].not_storable), key=lambda o: o)
        free = [o for o in producers if not by_id[o].not_storable]
        # Cheapest recompute per byte it frees first; ties by op id (deterministic).
        free.sort(key=lambda o: ((by_id[o].time_s + by_id[o].chain_s) / max(held[o], 1), o))
        name = records[0].type_name
        if type_key != records[0].type_key:   # profile.py NOTE [Op identity]
            name += f" ({type_key[-1][0]} {type_key[-1][1] + 1})"
        infos.append(TypeInfo(type_key, name, [b.index for b in records],
                              ops, saved, forced + free, len(forced),
                              not any(b.must_run_as_is for b in records)))
    return infos


def candidates(info: TypeInfo) -> list[int]:
    """Prefix lengths of the ranking worth trying: 0 (plain), then every per-op mode
    (none for a type that cannot be re-run)."""
    if not info.rerunnable:
        return [0]
    first = max(info.forced, 1)
    return [0] + list(range(first, len(info.ranking) + 1))
