"""What a profiled step is, as the search reads it: its ops (`OpRecord`), its stored
storages (`ItemRecord`, one per `Placement.decide` call, plus the records of the notes
named on its fields), its block calls (`BlockRecord`) and the step (`Profile`). The profiler
that fills them is profile.py, whose notes ([Op identity], [Micro-batches]) say what they
mean."""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Hashable

import torch

__all__ = ["OpRecord", "ItemRecord", "BlockRecord", "Profile"]


@dataclass
class OpRecord:
    """One op of one block's forward."""

    op_id: tuple[str, int]       # NOTE [Op identity]
    time_s: float                # the op alone (what recomputing it costs)
    out_bytes: int = 0           # bytes of the new storages it made
    not_storable: str | None = None   # why its output may not be stored (stored_ops.py Rule 1)
    seeded: bool = False         # consumes the RNG
    chain_s: float = 0.0         # in-place ops that later changed its output (re-run with it)


@dataclass
class ItemRecord:
    """One storage the hooks stored (one `Placement.decide` call)."""

    region: tuple                # ("block", k) or ("after", k): outside blocks, after block k
    ordinal: int                 # position among the region's stored storages
    nbytes: int
    hooks_key: Hashable          # the hooks' key, to join their pack / unpack clock
    eligible: bool               # may move at all (not small, not no_offload)
    producer: tuple[str, int] | None = None   # op inside the block that made it
    input_index: int | None = None            # the block's positional input it is
    pack_s: float | None = None               # seconds from step start
    unpack_s: float | None = None
    # Saves below OFFLOAD_MIN_BYTES: they never reach the placement (the hooks keep them at
    # once). Per region visit (placement.py `SchedulePlacement.note_small`, ordinal -1): one
    # record per op of a block that made some (`producer`), and one of the rest, with the
    # block's `small_inputs` (its inputs below OFFLOAD_MIN_BYTES, a re-run's checkpoint
    # holds them).
    small: bool = False
    small_inputs: int = 0
    # Backwards of the step begun before its save: with gradient accumulation in one
    # context, its micro-batch (NOTE [Micro-batches]); 0 for a step of one forward.
    segment: int = 0
    # Not a save: bytes an op made that no save used, held only where the op is stored
    # (unsaved_outputs.py NOTE [Unsaved outputs]).
    unsaved: bool = False
    # (block index, op id) that made it in an earlier block (that NOTE's rule 5)
    made_by: tuple | None = None
    # Saved again after its block (placement.py NOTE [Saved again after its block]): as a
    # later block call's input, (block index, input index); or as one of its block's outputs.
    fed_to: tuple | None = None
    block_output: bool = False
    # Not a save: a block input no save held, which a re-run's checkpoint holds (placement.py
    # NOTE [Inputs only a re-run saves]).
    rerun_input: bool = False

    @property
    def saved_again(self) -> bool:   # so re-running the op that made it frees none of it
        return self.fed_to is not None or self.block_output

    @property
    def key(self) -> tuple:
        return (self.region, self.ordinal)

    @property
    def block(self) -> int | None:
        return self.region[1] if self.region[0] == "block" else None


@dataclass
class BlockRecord:
    index: int
    type_key: tuple
    type_name: str
    signature: tuple
    ops: list[OpRecord] = field(default_factory=list)
    forward_s: float = 0.0
    opaque: bool = False   # compiled: ran whole, no op seen (BlockProfiler.run)
    # A tensor input of the call was changed in place after the call began (by the block,
    # or by its caller before backward): a re-run would not see the input the call saw, and
    # checkpoint raises autograd's in-place error for it. It runs as it is.
    inputs_changed: bool = False
    # It called a collective (torch.distributed's c10d or functional ops): it runs as it
    # is (plan_cache.py NOTE [Blocks run alike on every rank]).
    collective: bool = False
    # Its backward read a saved tensor twice, or ran under vmap and it draws random
    # numbers: it runs as it is (profile.py NOTE [Reads a re-run refuses]).
    rerun_refused: bool = False
    # A planned step found it runs as it is from then on (reruns.py: a re-run torch's
    # checkpoint refused, a collective its profile did not see): `PlanCache.as_is`.
    learned_as_is: bool = False

    @property
    def must_run_as_is(self) -> bool:
        """Whether a re-run of it cannot be trusted: it runs as it is in every step."""
        return self.collective or self.inputs_changed or self.rerun_refused or \
            self.learned_as_is
    # op id -> bytes of the storages it made that the block saved below OFFLOAD_MIN_BYTES
    # (the hooks keep those at once: the placement never sees them; note_small does).
    small_saved: dict = field(default_factory=dict)
    # (op id, below OFFLOAD_MIN_BYTES) -> bytes of the storages it made that no save of the
    # step used (unsaved_outputs.py NOTE [Unsaved outputs]); the call's micro-batch.
    unsaved: dict = field(default_factory=dict)
    segment: int = 0


@dataclass
class Profile:
    """One profiled step. Times in seconds; `forward_s` / `backward_s` are compute (the
    step's stalls and the profiler's own bookkeeping taken out)."""

    device: torch.device
    forward_s: float
    backward_s: float
    saved_bytes: int
    blocks: list[BlockRecord]
    items: list[ItemRecord]
    # Region -> how many times the step entered it (plan.py NOTE [More calls than profiled])
    visits: dict = field(default_factory=dict)
    # Blocks the step ran as is, needing no gradient (recompute.py NOTE [Calls that run as
    # is]): not profiled
    ran_as_is: frozenset = frozenset()

    @property
    def peak_saved_bytes(self) -> int:
        """What the step saves at most at once (NOTE [Micro-batches]): `saved_bytes`, less
        what the micro-batches other than the largest saved. For a step of one forward,
        `saved_bytes`."""
        per = self.segment_bytes()
        return self.saved_bytes - sum(per.values()) + max(per.values()) if len(per) > 1 \
            else self.saved_bytes

    def segment_bytes(self) -> dict[int, int]:
        """Bytes of the step's saves per micro-batch (ItemRecord.segment)."""
        per: Counter[int] = Counter()
        for it in self.items:
            per[it.segment] += 0 if it.unsaved or it.rerun_input else it.nbytes
        return per

    def block_types(self) -> dict[tuple, list[BlockRecord]]:
        """Blocks planned together: one type that ran one op sequence (NOTE [Op identity]).
        A type's first sequence is keyed by its type key, any other by the type key plus
        ("op sequence", n)."""
        out: dict[tuple, list[BlockRecord]] = {}
        sequences: dict[tuple, list[tuple]] = defaultdict(list)
        for b in self.blocks:
            seq = tuple(o.op_id for o in b.ops)
            seen = sequences[b.type_key]
            if seq not in seen:
                seen.append(seq)
            n = seen.index(seq)
            out.setdefault(b.type_key if n == 0 else b.type_key + (("op sequence", n),),
                           []).append(b)
        return out

    def op_table(self, type_key: tuple) -> list[OpRecord]:
        """The ops of one entry of `block_types`, times the median over its instances."""
        records = self.block_types()[type_key]
        first = records[0].ops
        out = []
        for i, op in enumerate(first):
            out.append(OpRecord(
                op.op_id, statistics.median(r.ops[i].time_s for r in records),
                op.out_bytes, op.not_storable, op.seeded,
                statistics.median(r.ops[i].chain_s for r in records)))
        return out


# The dispatcher namespaces of torch.distributed's collectives (`dist.all_reduce` runs
# c10d::allreduce_; functional collectives and DTensor's run _c10d_functional ops).
