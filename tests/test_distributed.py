"""DDP and FSDP2 (`fully_shard` per block, and inside blocks) under `offload.activations()`: 2 gloo ranks on
CPU, each rank's NVMe directory from `{rank}`, weights bit-exact against the same
distributed run without offload, nothing left in the directories afterwards, and the
capacities of a `%` setting divided between the two ranks of this host.

Each rank trains the same model twice in one process group: first without any offload
context, then with one; same initial weights, same per-rank batches, same dropout masks.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import offload
from distributed import run_ranks, stop_forkserver
from mounts import free_bytes
from offload._ext import core_available
from offload.bench.models import GPT, GPTConfig
from offload.schedule import collectives

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not core_available(), reason="offload._C unavailable")]

MiB = 1 << 20
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _own_forkserver():
    """The ranks fork from a server that has imported torch only (not one offload-bench's
    tests left, with the benchmark imported), and the benchmark's tests after these start
    theirs with their own imports."""
    stop_forkserver()
    yield
    stop_forkserver()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, hidden=64, layers=2, heads=4, seq_len=32))


def _train(wrap, use_offload: bool, steps: int = STEPS) -> tuple[list[torch.Tensor], list[dict]]:
    """`steps` optimizer steps of `wrap(model)`; the local parameters after, and stats."""
    rank = dist.get_rank()
    model = wrap(_gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    torch.manual_seed(1000 + rank)                      # and its own dropout masks
    stats = []
    for _ in range(steps):
        idx = torch.randint(128, (4, 32), generator=data)
        tgt = torch.randint(128, (4, 32), generator=data)
        ctx = offload.activations(model=model, tiers="nvme", min_bytes=0) if use_offload \
            else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
            if use_offload:
                paths = ctx.tiers["nvme"].paths
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_offload:
            stats.append({**ctx.stats.as_dict(), "paths": paths})
    return [_local(p).detach().clone() for p in model.parameters()], stats


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2 parameters are DTensors


def _compare(wrap, steps: int = STEPS) -> dict:
    plain, _ = _train(wrap, use_offload=False, steps=steps)
    offloaded, stats = _train(wrap, use_offload=True, steps=steps)
    offload.empty_cache()  # the slab files close here, not at interpreter exit
    return {"equal": [torch.equal(a, b) for a, b in zip(plain, offloaded)],
            "changed": not torch.equal(plain[0], _local(_gpt().tok_emb.weight)),
            "stats": stats}


def _ddp_worker() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _compare(lambda m: DDP(m))


def _fsdp2_worker(steps: int = STEPS, inside: bool = False) -> dict:
    """FSDP2 per block; `inside`: on each block's attention and MLP too (as MoE experts)."""
    from torch.distributed.fsdp import fully_shard

    def wrap(model):
        for block in model.blocks:
            if inside:
                fully_shard(block.attn)
                fully_shard(block.mlp)
            fully_shard(block)
        fully_shard(model)
        return model

    return _compare(wrap, steps)


def _one_step_worker() -> dict:
    """One DDP step with offload: what the rank's tiers got."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _gpt()
    ddp = DDP(model)
    idx = torch.randint(128, (4, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    with offload.activations(model=model, tiers="nvme", min_bytes=0) as ctx:
        paths = ctx.tiers["nvme"].paths
        F.cross_entropy(ddp(idx).flatten(0, 1), idx.flatten()).backward()
    offload.empty_cache()
    return {**ctx.stats.as_dict(), "paths": paths}


@contextlib.contextmanager
def _rank_dirs(root: str):
    """`root`/0 and `root`/1, named by OFFLOAD_NVME_DIR=`root`/{rank}; removed afterwards
    (whether empty is for `_check` to say)."""
    dirs = [os.path.join(root, str(r)) for r in range(2)]
    for d in dirs:
        os.mkdir(d)
    try:
        yield dirs, {"OFFLOAD_NVME_DIR": os.path.join(root, "{rank}")}
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _check(results: list[dict], dirs: list[str]) -> None:
    for rank, (res, own_dir) in enumerate(zip(results, dirs)):
        assert all(res["equal"]), f"rank {rank}: parameters differ: {res['equal']}"
        assert res["changed"], "training did not change the weights: the check proves nothing"
        for step in res["stats"]:
            assert step["paths"] == [os.path.realpath(own_dir)]
            assert step["nvme_bytes"] > 0 and step["exit_nvme_used_bytes"] == 0
        assert os.listdir(own_dir) == [], f"rank {rank} left files: {os.listdir(own_dir)}"


def _fsdp2_frozen_worker() -> dict:
    """FSDP2 with a frozen first block: its weights are all-gathered into unsharded
    `nn.Parameter`s of another storage than the sharded ones `model=` names, and autograd
    saves views of them (`weight.t()`). None of those may be moved."""
    from torch.distributed.fsdp import fully_shard

    from offload.runtime.storing import Storer

    moved_weights = []
    original = Storer.store

    def spy(self, t, storage, *args, **kwargs):
        record = original(self, t, storage, *args, **kwargs)
        base = t._base if t._base is not None else t
        if record.payload is not None and isinstance(base, torch.nn.Parameter):
            moved_weights.append(tuple(t.shape))
        return record

    def wrap(model):
        model.blocks[0].requires_grad_(False)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    Storer.store = spy
    try:
        result = _compare(wrap)
    finally:
        Storer.store = original
    return {**result, "moved_weights": moved_weights}


def test_fsdp2_frozen_weights_are_never_moved(nvme_dir):
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(_fsdp2_frozen_worker, env=env)
        _check(results, dirs)
    for rank, res in enumerate(results):
        assert res["moved_weights"] == [], f"rank {rank} moved weights {res['moved_weights']}"


@pytest.mark.parametrize("policy", ["offload", "auto", "recompute"])
@pytest.mark.parametrize("worker", [_ddp_worker, _fsdp2_worker], ids=["ddp", "fsdp2"])
def test_bit_exact_with_per_rank_nvme_dirs(worker, policy, nvme_dir):
    """`auto` (budget unset: 0) profiles the first step and plans from the second, wrapping
    the blocks it recomputes in checkpoint inside DDP / under FSDP2's per-block sharding;
    `recompute` checkpoints every block and sends the block inputs to the tier."""
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(worker, env={**env, "OFFLOAD_POLICY": policy})
        _check(results, dirs)


@pytest.mark.parametrize("policy,world", [("recompute", 2), ("auto", 1)])
def test_fsdp2_sharding_inside_a_block(policy, world, nvme_dir):
    """A block whose attention and MLP are sharded on their own holds their DTensors when
    it is called and the unsharded weights when it re-runs: the re-run put the DTensors back
    (as for functional_call) and raised "mixed torch.Tensor and DTensor" under `recompute`,
    and in `auto`'s checkpoint trial (one rank: with two, the attention's all-gathers make
    the blocks run as they are). weights.py NOTE [Sharded weights]. Eight steps: `auto`'s
    trials included."""
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(_fsdp2_worker, 8, True, world=world,
                            env={**env, "OFFLOAD_POLICY": policy})
        _check(results, dirs)


class _RowParallelBlock(torch.nn.Module):
    """A tensor-parallel block: each rank holds a shard, the output is all-reduced."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        dist.all_reduce(y)
        return x + torch.tanh(y)


def _tensor_parallel_worker(policy: str) -> dict:
    """Six steps of three row-parallel blocks, the same batches on both ranks, without and
    with offload. Rank 1 measures a slower disk (as a rank on another host may), so the
    ranks' auto plans and trials differ."""
    rank = dist.get_rank()
    if rank == 1:
        os.environ["OFFLOAD_PROBE"] = "nvme_write_gbps=0.001,nvme_read_gbps=0.001"
    plain, ours = _plain_and_offload(
        lambda: torch.nn.Sequential(*[_RowParallelBlock() for _ in range(3)]), policy, 6)
    return {"equal": [torch.equal(a, b) for a, b in zip(plain, ours)]}


def _plain_and_offload(make, policy: str, steps: int, each_step=None):
    """The weights of `make()` (seeded by rank: each rank its own shards) after `steps` SGD
    steps on the same batches, without and with a context of `policy` per step;
    `each_step(model, step)` before each."""
    def train(use_offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(dist.get_rank())
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(7)
        for step in range(steps):
            if each_step is not None:
                each_step(model, step)
            x = torch.randn(4, 64, 32, generator=data)
            ctx = offload.activations(model=model, policy=policy, tiers="nvme", min_bytes=0) \
                if use_offload else contextlib.nullcontext()
            with ctx:
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    plain, ours = train(False), train(True)
    offload.empty_cache()
    return plain, ours


@pytest.mark.parametrize("policy", ["auto", "recompute"])
def test_a_block_calling_a_collective_runs_alike_on_every_rank(policy, nvme_dir):
    """plan_cache.py NOTE [Blocks run alike on every rank]: each rank plans auto on its own,
    so one rank re-ran a block (a checkpoint trial, a plan that recomputes) while the other
    did not, and their all_reduces paired up wrongly: rank 0 ended with other weights and
    no error. A block a profile saw call a collective runs as it is on every rank now."""
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(_tensor_parallel_worker, policy, env=env)
    for rank, res in enumerate(results):
        assert all(res["equal"]), f"rank {rank}: parameters differ: {res['equal']}"


class _LateCollectiveBlock(_RowParallelBlock):
    """A row-parallel block whose all_reduce starts only when `sync` is set: after the
    profiled step (a branch on the step, as a statistic synced every k steps would).
    `call`: dist.all_reduce, the same with async_op=True, the functional one on an expanded
    input (read only: it cannot be written), a ring exchange of sends and receives, an
    async all_gather whose input is read before the wait, a send received after the
    block (`_LateModel`), or an all_reduce whose result the block returns unused."""

    sync = False
    call = "all_reduce"

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        if self.sync and self.call == "all_reduce":
            dist.all_reduce(y)
        elif self.sync and self.call == "async_op":
            work = dist.all_reduce(y, async_op=True)   # the re-run's wait is on the
            work.wait()                                 # forward's Work, done
        elif self.sync and self.call == "functional":
            stat = x.detach().mean(0, keepdim=True).expand_as(x)
            y = y + funcol.all_reduce(stat, "avg", dist.group.WORLD)
        elif self.sync and self.call == "gather":
            full = y.new_empty((dist.get_world_size() * y.shape[0], *y.shape[1:]))
            work = dist.all_gather_into_tensor(full, y.detach().contiguous(), async_op=True)
            y = y * 1.5   # reads the gather's input while it is in flight: allowed
            work.wait()
            y = y + full.view(-1, *y.shape).mean(0)
        elif self.sync and self.call == "returned":   # (no op of the block reads it)
            dist.all_reduce(y)
            return y
        elif self.sync and self.call == "send":   # received by _LateModel after the block
            self.work = dist.isend(y.detach().contiguous(), (dist.get_rank() + 1) %
                                   dist.get_world_size())
        elif self.sync:   # every rank posts both before waiting for either
            rank, world = dist.get_rank(), dist.get_world_size()
            got = torch.empty_like(y)
            for work in dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, y.detach().contiguous(), (rank + 1) % world),
                    dist.P2POp(dist.irecv, got, (rank - 1) % world)]):
                work.wait()
            y = y + got
        return x + torch.tanh(y)


class _LateModel(torch.nn.Module):
    """Three `_LateCollectiveBlock`s; after each that sent (`call="send"`), the receive from
    the previous rank and the send's wait."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_LateCollectiveBlock() for _ in range(3))
        for block in self.blocks:
            block.call = call

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if block.sync and block.call == "send":
                got = torch.empty_like(x)
                dist.recv(got, (dist.get_rank() - 1) % dist.get_world_size())
                block.work.wait()
                x = x + 0.1 * got
        return x


def _late_collective_worker(policy: str, first_sync: int, call: str) -> dict:
    """Eight steps of three blocks whose all_reduce starts at step `first_sync`; rank 1
    measures a slower disk, so the ranks' auto plans differ (one re-runs blocks the other
    does not)."""
    rank = dist.get_rank()
    if rank == 1:
        os.environ["OFFLOAD_PROBE"] = "nvme_write_gbps=0.001,nvme_read_gbps=0.001"

    def each_step(model, step: int) -> None:
        for block in model.blocks:
            block.sync = step >= first_sync

    plain, ours = _plain_and_offload(lambda: _LateModel(call), policy, 8, each_step)
    gc.collect()
    return {"equal": [torch.equal(a, b) for a, b in zip(plain, ours)],
            "kept alive": sum(isinstance(o, collectives._Kept) for o in gc.get_objects())}


@pytest.mark.parametrize("first_sync, call", [(3, "all_reduce"), (5, "all_reduce"),
                                              (3, "async_op"), (4, "functional"),
                                              (3, "ring"), (3, "gather"), (3, "send"),
                                              (3, "returned")])
def test_a_block_first_calling_a_collective_after_its_profile_gets_exact_weights(
        first_sync, call, nvme_dir):
    """collectives.py NOTE [A re-run calls no collective]: a block that first calls a
    collective in a planned step (its profile saw none) was re-run in backward on the rank
    whose plan recomputes it, calling its all_reduce a second time there only: the
    collectives paired up wrongly, silent wrong weights on one rank and a hang on the
    other. The re-run hands back the forward's results instead. Also: a ring of sends and
    receives deadlocked (each rank waited for its send before posting its receive); an
    expanded input was written into (an error in backward); the forward's c10d Work, held
    for the re-run, kept every graph that found a collective alive for good (a cycle
    through C++). And: an async all_gather's output was copied before its wait, at a read of
    its input; a send received after the block deadlocked at the block's end."""
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(_late_collective_worker, "auto", first_sync, call, env=env,
                            timeout_s=60)
    for rank, res in enumerate(results):
        assert all(res["equal"]), f"rank {rank}: parameters differ: {res['equal']}"
        assert res["kept alive"] == 0, res


def _context_before_the_group_worker(rendezvous: str) -> dict:
    """One context built before the process group starts, then entered every step: the
    late all_reduce of `_LateCollectiveBlock` from step 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()   # (run_ranks starts one: built before it, here)
    if rank == 1:
        os.environ["OFFLOAD_PROBE"] = "nvme_write_gbps=0.001,nvme_read_gbps=0.001"
    models = []
    for _ in range(2):
        torch.manual_seed(rank)
        models.append(torch.nn.Sequential(*[_LateCollectiveBlock() for _ in range(3)]))
    plain, model = models
    ctx = offload.activations(model=model, policy="auto", tiers="nvme", min_bytes=0)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    for m, use in ((plain, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(7)
        for step in range(8):
            for block in m:
                block.sync = step >= 3
            with ctx if use else contextlib.nullcontext():
                m(torch.randn(4, 64, 32, generator=data)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    offload.empty_cache()
    return {"equal": [torch.equal(a, b) for a, b in zip(plain.parameters(),
                                                        model.parameters())]}


def test_a_context_built_before_the_process_group_watches_its_blocks(nvme_dir, tmp_path):
    """collectives.py NOTE [A re-run calls no collective]: whether the job has many ranks
    was read when the context was built; one built before `init_process_group` and
    reused never watched its blocks, and the late all_reduce paired wrongly again."""
    with _rank_dirs(nvme_dir) as (dirs, env):
        results = run_ranks(_context_before_the_group_worker, str(tmp_path / "rendezvous"),
                            env=env, timeout_s=60)
    for rank, res in enumerate(results):
        assert all(res["equal"]), f"rank {rank}: parameters differ: {res['equal']}"


def _handed_back_worker() -> dict:
    """collectives.modes under a plain checkpoint: a retained graph's two backwards, then a
    re-run that reaches a collective its forward did not call."""
    from torch.utils.checkpoint import checkpoint

    from offload.schedule import collectives
    calls = []
    sync = [True]

    def block(x):
        y = x * 2
        if sync[0]:
            dist.all_reduce(y)
        return y.sin()

    def context_fn():
        return collectives.modes(calls.append, "block")

    x = torch.randn(8, generator=torch.Generator().manual_seed(dist.get_rank()),
                    requires_grad=True)
    plain = torch.autograd.grad(block(x).sum(), x)[0]
    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    second = torch.autograd.grad(out, x)[0]
    sync[0] = False
    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum()
    sync[0] = True
    try:
        out.backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    dist.barrier()   # the ranks still pair up: the failing re-run called nothing
    return {"equal": [torch.equal(plain, first), torch.equal(plain, second)],
            "calls": calls, "error": error}


def test_a_re_run_hands_back_the_forwards_collective_and_calls_none():
    """collectives.py NOTE [A re-run calls no collective]: both backwards of a retained
    graph get the forward's all_reduce (bit-exact); a re-run that reaches a collective
    its forward did not call raises, naming it, before calling it."""
    for res in run_ranks(_handed_back_worker, timeout_s=60):
        assert res["equal"] == [True, True]
        assert res["calls"] == ["c10d.allreduce_.default"]
        assert "c10d.allreduce_.default" in res["error"] and "did not call" in res["error"]


def test_two_ranks_split_a_percentage_of_one_disk(small_disk):
    """Both ranks' NVMe budgets together stay within OFFLOAD_NVME_BYTES=50% of the free space
    of the file system they share, in equal parts (before: each took 50 % of what the other
    left)."""
    with _rank_dirs(small_disk) as (dirs, env):
        free = free_bytes(small_disk)
        results = run_ranks(_one_step_worker, env={**env, "OFFLOAD_NVME_BYTES": "50%"})
        for res, own_dir in zip(results, dirs):
            assert res["paths"] == [os.path.realpath(own_dir)] and res["nvme_bytes"] > 0
            assert os.listdir(own_dir) == []
    capacities = [res["nvme_capacity_bytes"] for res in results]
    # Both divide the free space the first of them measured (ranks.py NOTE [Host share]),
    # whichever opens its store first, rounded down to whole 1 MiB chunks.
    assert capacities[0] == capacities[1], capacities
    assert free // 2 // 2 - MiB < capacities[0] <= free // 2 // 2, (capacities, free)
