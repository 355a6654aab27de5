"""Behaviour of offload.activations(): what moves, what stays, views, dtypes, in-place ops,
spill order, errors inside the block, lifetimes, stats."""
from __future__ import annotations

import copy
import gc
import io
import json
import logging
import os
import pickle
import threading
import time

import pytest
import torch

import offload
from offload.config import Config
from offload.errors import ConfigError, TierFullError
from offload.bench.models import GPT, ConvNet, GPTConfig

try:
    from offload._ext import load_core

    load_core()
    HAVE_CORE, CORE_REASON = True, ""
except Exception as exc:
    HAVE_CORE, CORE_REASON = False, str(exc)

needs_core = pytest.mark.skipif(not HAVE_CORE, reason="offload._C unavailable")

TIERS = ["host", pytest.param("nvme", marks=needs_core)]


def _kw(tiers: str, nvme_dir: str, **extra):
    kw = {"tiers": tiers, "min_bytes": 0, "policy": "offload"}
    if "nvme" in tiers:
        kw.update(nvme_dir=nvme_dir, nvme_bytes="64MiB", staging_bytes="2MiB",
                  prefetch_bytes="256KiB")
    kw.update(extra)
    return kw


class Probe(torch.autograd.Function):
    """Saves its inputs as given (any dtype, any layout) and checks them in backward."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.save_for_backward(x, *others)
        ctx.expect = [(t.clone(), t.shape, t.stride(), t.storage_offset(), t.dtype,
                       t.is_conj(), t.device) for t in (x, *others)]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        for t, (ref, shape, stride, offset, dtype, conj, device) in zip(ctx.saved_tensors,
                                                                       ctx.expect):
            assert t.dtype == dtype and t.shape == shape and t.device == device
            assert t.stride() == stride and t.storage_offset() == offset
            assert t.is_conj() == conj
            assert torch.equal(t, ref)
        return (grad,) + (None,) * (len(ctx.expect) - 1)


@pytest.mark.parametrize("tiers", TIERS)
def test_every_dtype_and_layout_round_trips(tiers, nvme_dir):
    x = torch.randn(8, 6, requires_grad=True)
    base = torch.arange(4 * 7 * 5, dtype=torch.float64).reshape(4, 7, 5)
    others = [
        torch.rand(5, 7) > 0.5,                                   # bool
        torch.randn(9, 3).to(torch.bfloat16),
        torch.randn(9, 3).to(torch.float16),
        torch.randn(4, 4, dtype=torch.complex64),
        torch.randn(4, 4, dtype=torch.complex128).conj(),         # lazy conj bit
        torch.randint(-5, 5, (3, 11), dtype=torch.int8),
        torch.randint(0, 1 << 40, (7,), dtype=torch.int64),
        base.transpose(0, 2),                                      # non-contiguous
        base[1:, 2:5, ::2],                                        # offset + strides
        torch.randn(1, 5).expand(6, 5),                            # stride 0
        torch.randn(6)[3],                                         # 0-dim view with offset
    ]
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        y = Probe.apply(x * 1, *others)
        y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert ctx.stats.offloaded_tensors == len(others) + 1
    assert ctx.stats.exit_nvme_used_bytes == 0


@pytest.mark.parametrize("tiers", TIERS)
def test_views_of_one_storage_are_stored_once(tiers, nvme_dir):
    x = torch.randn(16, 3 * 64, requires_grad=True)
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        qkv = x * 2
        q, k, v = qkv.split(64, dim=1)            # three strided views of one storage
        y = Probe.apply(q, k, v, qkv.t())
        y.sum().backward()
    storage_bytes = 16 * 3 * 64 * 4
    # Probe saves q, k, v, qkv.t() (one storage); the `x * 2` node saves nothing big.
    assert ctx.stats.unique_storages == 1
    assert ctx.stats.saved_bytes == storage_bytes
    assert ctx.stats.offloaded_tensors == 4


@pytest.mark.parametrize("with_model", [True, False], ids=["model=", "no model="])
def test_parameters_buffers_and_their_views_never_move(nvme_dir, with_model):
    model = ConvNet(channels=4)
    x = torch.randn(2, 3, 8, 8)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    buffer_storages = {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen = []
    from offload.runtime.storing import Storer

    orig_store = Storer.store

    def spy(self, t, storage, *rest):
        seen.append(storage.data_ptr())
        return orig_store(self, t, storage, *rest)

    Storer.store = spy
    try:
        with offload.activations(tiers="host", min_bytes=0,
                                 model=model if with_model else None) as ctx:
            model(x).sum().backward()
    finally:
        Storer.store = orig_store
    # Parameters and views of them are recognised without model= (leaves needing grad);
    # buffers (BatchNorm statistics) only through it: no process-wide module hook.
    assert seen and not (set(seen) & param_storages)
    if with_model:
        assert not (set(seen) & buffer_storages)
    assert ctx.stats.param_tensors > 0 and ctx.stats.param_bytes > 0


def test_weight_t_views_and_tied_weights_are_parameters():
    cfg = GPTConfig(vocab_size=64, hidden=32, layers=1, heads=2, seq_len=16, dropout=0.0)
    model = GPT(cfg)
    idx, tgt = model.example_batch(2)
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        model.loss(idx, tgt).backward()
    # Every Linear saves weight.t(); the head's weight is the tied embedding.
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert ctx.stats.param_tensors >= n_linear
    # param_bytes counts each parameter storage once, never more than the model holds.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < ctx.stats.param_bytes <= total


@pytest.mark.parametrize("tiers", ["keep", "host", pytest.param("nvme", marks=needs_core)])
def test_inplace_after_save_raises_autograd_error(tiers, nvme_dir):
    def step():
        a = torch.randn(4096, requires_grad=True)
        b = a * 2
        c = b.sin()          # saves b
        b.add_(1)            # version 0 -> 1
        c.sum().backward()

    with pytest.raises(RuntimeError) as plain:
        step()
    kw = {"policy": "keep"} if tiers == "keep" else _kw(tiers, nvme_dir)
    with pytest.raises(RuntimeError) as got:
        with offload.activations(**kw):
            step()
    assert str(got.value) == str(plain.value)
    assert "modified by an inplace operation" in str(got.value)


@pytest.mark.parametrize("tiers", TIERS)
def test_inplace_on_view_base_raises(tiers, nvme_dir):
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*expected "
                       "version 0 instead"):
        with offload.activations(**_kw(tiers, nvme_dir)):
            a = torch.randn(64, 64, requires_grad=True)
            base = a * 1
            view = base[:, :32]
            out = view.exp()       # saves its result (exp's output)
            out2 = view.sin()      # saves view (a view of base)
            base.mul_(2)           # bumps the shared version counter
            (out.sum() + out2.sum()).backward()


@pytest.mark.parametrize("tiers", TIERS)
def test_legit_inplace_ops_are_exact(tiers, nvme_dir):
    def run(ctx):
        torch.manual_seed(0)
        a = torch.randn(256, 256, requires_grad=True)
        with ctx:
            h = torch.relu(a @ a)          # relu saves its output
            h2 = h.clone()
            h2.mul_(3).add_(1)             # in-place on a fresh tensor
            torch.nn.functional.relu(h2, inplace=True)
            (h2 * h).sum().backward()
        return a.grad

    import contextlib

    ref = run(contextlib.nullcontext())
    assert torch.equal(ref, run(offload.activations(**_kw(tiers, nvme_dir))))


@pytest.mark.parametrize("tiers", TIERS)
def test_double_backward(tiers, nvme_dir):
    def run(ctx):
        x = torch.linspace(-2, 2, 5000, requires_grad=True)
        with ctx:
            y = (x.sin() * x ** 3).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            g.sum().backward()
        return x.grad

    import contextlib

    assert torch.equal(run(contextlib.nullcontext()), run(offload.activations(**_kw(tiers, nvme_dir))))


@pytest.mark.parametrize("tiers", TIERS)
def test_retain_graph_second_backward(tiers, nvme_dir):
    x = torch.randn(128, 128, requires_grad=True)
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        y = (x @ x).tanh().sum()
        y.backward(retain_graph=True)
        first = x.grad.clone()
        y.backward()
    assert torch.equal(x.grad, 2 * first)
    del y
    gc.collect()
    assert ctx.stats.exit_nvme_used_bytes == 0


def test_no_offload_region_keeps():
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        a = x.sin()                       # saves x: a parameter-like leaf, stays
        with offload.no_offload():
            b = a.cos()                   # saves a: kept
        c = b.exp()                       # saves its output: offloaded
        c.sum().backward()
    n = 256 * 256 * 4
    assert ctx.stats.kept_bytes == n and ctx.stats.host_bytes == n
    with offload.no_offload():            # harmless outside a context, nests
        with offload.no_offload():
            pass
    assert not offload.runtime.hooks.no_offload_active()


def test_no_offload_is_per_thread():
    """As the saved-tensor hooks: a thread started inside the region saves as usual, and
    its own region ends with it."""
    from offload.runtime.no_offload import no_offload_active

    seen = []

    def other():
        seen.append(no_offload_active())
        with offload.no_offload():
            seen.append(no_offload_active())
        seen.append(no_offload_active())

    with offload.no_offload():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert no_offload_active()
    assert seen == [False, True, False] and not no_offload_active()


def test_min_bytes_and_keep_policy():
    x = torch.randn(64, requires_grad=True)
    with offload.activations(tiers="host", min_bytes="1KiB") as ctx:
        small = (x * 1).sin()                              # 256 B: stays
        big = (x.repeat(16) * 1).sin()                     # 4 KiB: moves
        (small.sum() + big.sum()).backward()
    assert ctx.stats.kept_bytes == 256 and ctx.stats.host_bytes == 4096
    with offload.activations(policy="keep", min_bytes=0) as ctx:
        (x.repeat(16) * 1).sin().sum().backward()
    assert ctx.stats.kept_bytes == ctx.stats.saved_bytes == 4096


def test_backward_after_the_block(nvme_dir):
    if not HAVE_CORE:
        pytest.skip(CORE_REASON)
    x = torch.randn(128, 128, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir)) as ctx:
        y = (x @ x).tanh().sum()
    nvme = ctx.tiers["nvme"]
    assert nvme.used_bytes > 0                         # still open: backward needs it
    y.backward()
    ref = torch.autograd.grad((x @ x).tanh().sum(), x)[0]
    assert torch.equal(x.grad, ref)
    assert nvme._closed and ctx.stats.exit_nvme_used_bytes == 0


def test_the_writes_still_batched_go_at_the_blocks_exit(nvme_dir):
    """A backward run after the block may come much later: the writes held back to batch
    (csrc/nvme_transfers.hpp NOTE [Write batches]) go to the disk at the exit, not at the
    backward's first read (was: 0 bytes written until then, their sources kept in RAM)."""
    if not HAVE_CORE:
        pytest.skip(CORE_REASON)
    x = torch.randn(128, 128, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir)) as ctx:
        y = (x * 2).sin().tanh().sum()            # 2 writes of 64 KiB: one batch, unsent
    nvme = ctx.tiers["nvme"]
    deadline = time.monotonic() + 10
    while ctx.stats.nvme_written_bytes < ctx.stats.nvme_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
        nvme.poll()                               # retires what landed
    assert ctx.stats.nvme_bytes == 2 * 128 * 128 * 4
    assert ctx.stats.nvme_written_bytes == ctx.stats.nvme_bytes
    y.backward()
    assert torch.equal(x.grad, torch.autograd.grad((x * 2).sin().tanh().sum(), x)[0])


@pytest.mark.parametrize("how", ["close", "raise"])
def test_a_step_freed_early_says_what_it_still_held(nvme_dir, how):
    """exit_{tier}_used_bytes: the space a step still held when it was freed before its
    stored tensors were (was: 0 always, the payloads being freed before it was read)."""
    x = torch.randn(256, 256, requires_grad=True)
    ctx = offload.activations(**_kw("nvme", nvme_dir))
    if how == "close":
        with ctx:
            y = (x * 2).sin().sum()
        ctx.close()
    else:
        with pytest.raises(ZeroDivisionError):
            with ctx:
                y = (x * 2).sin().sum()
                1 / 0
    assert ctx.stats.nvme_bytes == 256 * 256 * 4
    assert ctx.stats.exit_nvme_used_bytes == ctx.stats.nvme_bytes
    assert ctx.tiers["nvme"].closed and ctx.tiers["nvme"].used_bytes == 0
    with pytest.raises(offload.UsedAfterCloseError):
        y.backward()


@needs_core
def test_repeated_steps_do_not_grow(nvme_dir):
    cfg = GPTConfig(vocab_size=64, hidden=64, layers=2, heads=4, seq_len=32)
    model = GPT(cfg)
    idx, tgt = model.example_batch(2)
    ctx = offload.activations(**_kw("host,nvme", nvme_dir, host_bytes="128KiB"))
    peaks = []
    for _ in range(4):
        with ctx:
            model.loss(idx, tgt).backward()
        s = ctx.stats
        assert s.nvme_bytes > 0 and s.host_bytes > 0
        assert s.exit_nvme_used_bytes == s.exit_staging_used_bytes == 0
        assert s.exit_host_used_bytes == 0
        assert s.nvme_read_bytes >= s.nvme_bytes
        assert ctx._hooks.ledger.live_records == 0
        assert s.staging_peak_bytes <= 2 << 20   # bounded by OFFLOAD_STAGING_BYTES
        peaks.append((s.peak_resident_bytes, s.round_trip_kept_bytes))
    # Identical steps must not grow. Step 1 has no round-trip plan; later steps may keep a few
    # storages that would bounce (chosen from measured timings, so the choice can vary from
    # step to step) and may exceed step 1's resident peak by at most those bytes.
    first_peak, first_kept = peaks[0]
    assert first_kept == 0
    for peak, kept in peaks[1:]:
        assert peak <= first_peak + kept, peaks


@needs_core
def test_spill_to_next_tier(nvme_dir):
    x = torch.randn(64, 1024, requires_grad=True)     # 256 KiB per saved tensor
    with offload.activations(**_kw("host,nvme", nvme_dir, host_bytes="600KiB")) as ctx:
        y = x * 1
        for _ in range(5):
            y = y.sin()
        y.sum().backward()
    s = ctx.stats
    assert s.host_bytes == 2 * 256 * 1024 and s.nvme_bytes == 3 * 256 * 1024
    assert s.spilled_bytes == s.nvme_bytes


def test_all_tiers_full_warns_once_and_keeps(caplog):
    """Once per process and tier list (OFFLOAD_STRICT's "one-time warning"): not again in
    later steps, reused context or new; every step's figure counts what stayed."""
    offload.process.reset()   # this process may have said it already
    x = torch.randn(64, 1024, requires_grad=True)
    reused = offload.activations(tiers="host", host_bytes="300KiB", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for ctx in (reused, reused, offload.activations(tiers="host", host_bytes="300KiB",
                                                        min_bytes=0)):
            with ctx:
                y = x * 1
                for _ in range(4):
                    y = y.sin()
                y.sum().backward()
            assert ctx.stats.full_kept_bytes == 3 * 256 * 1024
    warnings = [r for r in caplog.records if "every tier is full" in r.getMessage()]
    assert len(warnings) == 1
    # the knobs as this code set them (keywords), not variables it never set
    assert "Raise host_bytes= or add a tier to tiers=; strict=True makes this an error" \
        in warnings[0].getMessage()
    # What happens is what the warning says: this one stays, smaller ones still move.
    assert "a 256 KiB activation stays" in warnings[0].getMessage()
    assert "smaller ones still move" in warnings[0].getMessage()
    assert ctx.stats.host_bytes == 256 * 1024 and ctx.stats.full_kept_bytes == 3 * 256 * 1024
    assert ctx.stats.kept_bytes == 3 * 256 * 1024


def test_steps_alive_at_once_share_the_host_capacity(nvme_dir, monkeypatch):
    """OFFLOAD_HOST_BYTES is per process (tiers/host_budget.py NOTE [One host budget]): four
    steps whose graphs all stay alive hold 3 MiB in host RAM between them, and the rest
    spills to nvme. Was: 2 MB in each step's own 3 MiB, 8 MB in all, nothing spilled."""
    from offload.tiers import host_budget

    monkeypatch.setattr(host_budget, "_budget", None)   # not one an earlier test left in use
    torch.manual_seed(0)
    xs = [torch.randn(500, 1000, requires_grad=True) for _ in range(4)]
    ref = []
    for x in xs:
        (x * 2).sin().sum().backward()
        ref.append(x.grad)
        x.grad = None
    reused = offload.activations(tiers="host,nvme", host_bytes="3MiB", nvme_dir=nvme_dir,
                                 min_bytes=0)
    losses, steps = [], []
    for i, x in enumerate(xs):
        ctx = reused if i % 2 else offload.activations(tiers="host,nvme", host_bytes="3MiB",
                                                        nvme_dir=nvme_dir, min_bytes=0)
        with ctx:
            losses.append((x * 2).sin().sum())
        steps.append(ctx.stats)   # a reused context's next step has Stats of its own
    assert [s.host_bytes for s in steps] == [2_000_000, 0, 0, 0]
    assert [s.nvme_bytes for s in steps] == [0, 2_000_000, 2_000_000, 2_000_000]
    assert all(s.host_capacity_bytes == 3 << 20 for s in steps)
    torch.stack(losses).sum().backward()
    assert all(torch.equal(x.grad, r) for x, r in zip(xs, ref))
    with offload.activations(tiers="host,nvme", host_bytes="3MiB", nvme_dir=nvme_dir,
                             min_bytes=0) as ctx:
        (xs[0] * 2).sin().sum().backward()
    assert ctx.stats.host_bytes == 2_000_000   # every earlier step's bytes were given back


def test_a_tensor_larger_than_every_tier_is_not_called_full(caplog):
    """Was: "every tier is full (host 0 B of 300 KiB used)" for a tier that was empty."""
    offload.process.reset()
    x = torch.randn(128, 1024, requires_grad=True)   # 512 KiB saves, a 300 KiB tier
    with caplog.at_level(logging.WARNING, logger="offload"):
        with offload.activations(tiers="host", host_bytes="300KiB", min_bytes=0) as ctx:
            (x * 1).sin().sum().backward()
    said = [r.getMessage() for r in caplog.records if "activation stays" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("offload: no tier can hold it whole "
                                                 "(host 0 B of 300 KiB used)"), said
    assert ctx.stats.full_kept_bytes == 512 * 1024
    with pytest.raises(TierFullError, match=r"no tier can hold it whole \(host 0 B of 300 KiB "
                       r"used\) and strict=True, .* \(raise host_bytes=, add a tier to tiers=, "
                       r"or pass strict=False"):
        with offload.activations(tiers="host", host_bytes="300KiB", min_bytes=0, strict=True):
            (x * 1).sin()


@pytest.mark.parametrize("set_by", ["keywords", "environment"])
@pytest.mark.parametrize("tiers", TIERS)
def test_strict_raises_tier_full(tiers, set_by, nvme_dir, monkeypatch):
    """The fix names the knobs as they were set: a variable the user never set was named
    before (`unset OFFLOAD_STRICT` for `strict=True`)."""
    x = torch.randn(64, 1024, requires_grad=True)
    # The engine rounds its capacity up to whole 1 MiB chunks: 4 such tensors fit.
    kw = _kw(tiers, nvme_dir, strict=True, host_bytes="300KiB", nvme_bytes="1MiB")
    if set_by == "keywords":
        fix = (rf"strict=True, so a 256 KiB activation cannot be placed \(raise {tiers}_bytes=, "
               r"add a tier to tiers=, or pass strict=False")
    else:
        for name in ("tiers", "strict", "host_bytes", "nvme_bytes"):
            value = kw.pop(name)
            monkeypatch.setenv(f"OFFLOAD_{name.upper()}", value if isinstance(value, str)
                               else str(int(value)))
        fix = (rf"OFFLOAD_STRICT=1, so a 256 KiB activation cannot be placed \(raise "
               rf"OFFLOAD_{tiers.upper()}_BYTES, add a tier to OFFLOAD_TIERS, or unset "
               r"OFFLOAD_STRICT")   # only the tier in use
    with pytest.raises(TierFullError, match=r"every tier is full \(" + tiers + r" .* used\) and "
                       + fix):
        with offload.activations(**kw):
            y = x * 1
            for _ in range(6):
                y = y.sin()


def test_strict_with_every_tier_in_use_does_not_say_add_a_tier(nvme_dir):
    x = torch.randn(64, 1024, requires_grad=True)
    kw = _kw("host,nvme", nvme_dir, strict=True, host_bytes="300KiB", nvme_bytes="1MiB")
    with pytest.raises(TierFullError, match=r"\(raise host_bytes= / nvme_bytes=, or pass "
                                            r"strict=False to keep"):
        with offload.activations(**kw):
            y = x * 1
            for _ in range(12):
                y = y.sin()


class Boom(Exception):
    pass


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_frees_everything_and_propagates(tiers, where, nvme_dir):
    x = torch.randn(256, 256, requires_grad=True)
    err = Boom("original")
    ctx = offload.activations(**_kw(tiers, nvme_dir))
    with pytest.raises(Boom) as info:
        with ctx:
            y = x.sin().cos().exp()
            if where == "backward":
                def hook(grad):
                    raise err
                y.register_hook(hook)
                y.sum().backward()
            raise err
    assert info.value is err
    # Hooks are gone: a new graph is not packed by this context any more.
    packed = ctx.stats.packed_tensors
    x.sin().sum().backward()
    assert ctx.stats.packed_tensors == packed
    from offload.tiers import pool

    assert pool._slots == {}              # nothing kept open for a next step either
    if tiers == "nvme":
        assert ctx.tiers["nvme"]._closed
        # The graph still alive in `y` now fails loudly instead of reading freed space.
        if where == "forward":
            with pytest.raises(RuntimeError, match="released it"):
                y.sum().backward()
    assert os.listdir(nvme_dir) == []


def test_context_is_reusable_and_not_reentrant():
    ctx = offload.activations(tiers="host")
    with ctx:
        with pytest.raises(offload.OffloadError, match="already active"):
            ctx.__enter__()
    with ctx:
        pass


def test_stats_as_dict_is_json_with_the_documented_names():
    x = torch.randn(512, 512, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        (x * 1).sin().exp().sum().backward()   # saves x * 1 and exp's output
    d = json.loads(json.dumps(ctx.stats.as_dict()))
    for name in ("saved_bytes", "kept_bytes", "host_bytes", "nvme_bytes", "peak_resident_bytes",
                 "nvme_written_bytes", "nvme_read_bytes", "stall_s", "d2h_gbps", "h2d_gbps",
                 "nvme_write_gbps", "nvme_read_gbps", "packed_tensors"):
        assert name in d
    assert d["saved_bytes"] == d["host_bytes"] == 2 * 512 * 512 * 4
    # On a CPU-only run the host tier is the device's memory: both count as resident.
    assert d["peak_resident_bytes"] == d["saved_bytes"]


@needs_core
def test_nvme_stats_and_prefetch(nvme_dir):
    x = torch.randn(64, 1024, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir)) as ctx:
        y = x * 1
        for _ in range(8):
            y = y.sin()
        y.sum().backward()
    s = ctx.stats
    assert s.nvme_bytes == s.nvme_written_bytes == s.nvme_read_bytes == 8 * 256 * 1024
    assert s.peak_resident_bytes == 0 and s.kept_bytes == 0
    assert s.prefetch_hits >= 6 and s.prefetch_hits + s.prefetch_misses == 8
    assert s.nvme_write_gbps > 0 and s.nvme_read_gbps > 0
    assert 0 < s.staging_peak_bytes <= 2 << 20


def test_log_info_prints_step_stats(caplog):
    x = torch.randn(64, 64, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="offload"):
        with offload.activations(tiers="host"):
            x.sin().sum().backward()
    assert any("saved" in r.getMessage() and "peak resident" in r.getMessage()
               for r in caplog.records)


def test_model_argument_is_accepted_and_none_is_fine():
    model = ConvNet(channels=4)
    with offload.activations(model=model, tiers="host", min_bytes=0) as ctx:
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert ctx.stats.param_tensors > 0
    with offload.activations(model=None):
        pass


@needs_core
def test_nvme_dir_placeholders_and_striping(tmp_path, monkeypatch):
    d0, d1 = tmp_path / "r2a", tmp_path / "r2b"
    d0.mkdir()
    d1.mkdir()
    monkeypatch.setenv("RANK", "2")
    x = torch.randn(256, 1024, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=f"{tmp_path}/r{{rank}}a,{tmp_path}/r{{rank}}b",
                             nvme_bytes="16MiB", min_bytes=0) as ctx:
        assert ctx.tiers["nvme"].paths == [str(d0), str(d1)]
        (x * 1).sin().cos().sum().backward()
    assert ctx.stats.nvme_bytes == 2 * 256 * 1024 * 4
    assert os.listdir(d0) == [] and os.listdir(d1) == []


def test_unknown_argument_and_bad_env_fail_before_anything(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_TIERS", "host,disk")
    with pytest.raises(ConfigError, match="OFFLOAD_TIERS='host,disk': unknown tier 'disk'"):
        with offload.activations():
            pytest.fail("the block must not run")


@needs_core
def test_nvme_tensors_larger_than_staging_and_reads_beyond_it(nvme_dir):
    # 1 MiB staging: 4 MiB tensors are written straight from their memory, and with an
    # 8 MiB read-ahead most reads land in plain aligned buffers instead of the arena.
    def run(ctx):
        torch.manual_seed(0)
        x = torch.randn(1024, 1024, requires_grad=True)
        with ctx:
            y = x * 1
            for _ in range(5):
                y = torch.tanh(y) * 1.5
            y.sum().backward()
        return x.grad

    import contextlib

    ctx = offload.activations(**_kw("nvme", nvme_dir, staging_bytes="1MiB",
                                    prefetch_bytes="8MiB"))
    assert torch.equal(run(contextlib.nullcontext()), run(ctx))
    s = ctx.stats
    assert s.nvme_bytes == s.nvme_written_bytes == s.nvme_read_bytes == 5 * (4 << 20)
    assert s.staging_peak_bytes == 0        # nothing fit the arena: direct writes, plain reads
    assert s.exit_nvme_used_bytes == 0 and s.exit_staging_used_bytes == 0


@needs_core
def test_unused_saved_tensors_free_their_space(nvme_dir):
    # Saved tensors that backward never needs (a branch without grad) die with the graph;
    # their extents (some with reads still in flight) must come back.
    x = torch.randn(512, 512, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir, prefetch_bytes="64MiB")) as ctx:
        a = (x * 1).sin()
        b = (x * 1).cos().exp()           # saved, then the graph is dropped unused
        del b
        a.sum().backward()
    assert ctx.stats.exit_nvme_used_bytes == 0 and ctx.stats.exit_staging_used_bytes == 0


def test_pool_reuses_clean_resources(nvme_dir):
    if not HAVE_CORE:
        pytest.skip(CORE_REASON)
    from offload.tiers import pool

    pool.clear()
    kw = _kw("nvme", nvme_dir)
    x = torch.randn(256, 256, requires_grad=True)
    stores = []
    for _ in range(2):
        with offload.activations(**kw) as ctx:
            stores.append(ctx.tiers["nvme"]._store)
            (x * 1).sin().sum().backward()
    assert stores[0] is stores[1]           # the second step took the first one's store
    ctx.close()                             # drops the pooled store and arena
    assert stores[0].closed


def test_inplace_through_a_detached_alias_still_raises():
    # The saved tensor itself dies; only a detach()ed alias (same storage and version
    # counter) is modified. Plain autograd raises; so must we, never a silently wrong grad.
    def step():
        x = torch.randn(1000, requires_grad=True)
        y = x * 2
        d = y.detach()
        z = y.sin()
        del y
        d.add_(1)
        z.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with offload.activations(tiers="host", min_bytes=0):
            step()


def test_no_offload_region_keeps_a_storage_moved_earlier(nvme_dir):
    x = torch.randn(100_000, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir)) as ctx:
        y = x * 2
        a = y.sin()              # saves y: moved to nvme
        with offload.no_offload():
            b = y.cos()          # saves y again: must stay where it is
        (a + b).sum().backward()
    assert ctx.stats.kept_bytes >= y.numel() * 4
    assert ctx.stats.nvme_bytes >= y.numel() * 4


def test_one_context_entered_from_two_threads_at_once_is_refused_cleanly():
    """The "already active" check and the claim are one step: two threads entering one
    context at once get one step and one clear refusal, never two steps (the second
    overwrote the first's, whose exit then failed and left its hooks on its thread)."""
    nn = torch.nn
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    x = torch.randn(512, 64)
    for _ in range(20):
        ctx = offload.activations(model=model, tiers="host", min_bytes=0)
        both_in = threading.Barrier(2)
        results = [None, None]

        def work(i, ctx=ctx, both_in=both_in, results=results):
            both_in.wait()
            try:
                with ctx:
                    loss = model(x).pow(2).sum()
                loss.backward()
                error = None
            except offload.OffloadError as e:
                error = str(e)
            left = torch._C._autograd._top_saved_tensors_default_hooks(False)
            results[i] = (error, left is None)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(clean for _, clean in results), "hooks left on a thread"
        errors = sorted((e for e, _ in results), key=lambda e: e is not None)
        assert errors[0] is None
        assert errors[1] is None or errors[1] == (
            "offload.activations(): this context is active on another thread; a context "
            "belongs to one thread at a time (saved-tensor hooks are per thread): build one "
            "context per thread")
        assert not ctx.active
    # A context holds no lock of its own: one built and not yet entered can be copied (a
    # model holding it, copied for an EMA).
    copy.deepcopy(offload.activations(model=model, tiers="host"))


class _HoldsItsContext(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x).tanh()
        return x


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_a_model_holding_its_context_can_be_copied_and_saved(policy, nvme_dir):
    """Were: TypeError (a thread lock: auto's; the core's HostLedger, SavedBytes, a module
    after a step) from deepcopy, AttributeError (a WeakSet's local function) from pickle and
    torch.save: a model keeping its context as an attribute could not be copied for an EMA
    or saved. A copy is a new context, never entered, on the copied model."""
    torch.manual_seed(0)
    model = _HoldsItsContext()
    model.ctx = offload.activations(model=model, policy=policy, tiers="nvme",
                                    nvme_dir=nvme_dir, min_bytes=0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    copies = [copy.deepcopy(model)]                       # never entered
    with model.ctx:
        model(x).sum().backward()
    copies.append(copy.deepcopy(model))                   # after a step
    with model.ctx:
        copies.append(copy.deepcopy(model))               # inside one
        saved = io.BytesIO()
        torch.save(model, saved)
        model(x).sum().backward()
    copies.append(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    for c in copies:
        assert c.ctx is not model.ctx and c.ctx.model is c and not c.ctx.active
        assert c.ctx.config == model.ctx.config
        plain = torch.autograd.grad(c(x).sum(), list(c.parameters()))
        with c.ctx:
            ours = torch.autograd.grad(c(x).sum(), list(c.parameters()))
        assert all(map(torch.equal, plain, ours))
        assert c.ctx.stats.nvme_bytes > 0
        if policy != "offload":   # its blocks are the copy's
            assert c.ctx._schedule.blocks == list(c.blocks)
    alone = pickle.loads(pickle.dumps(model.ctx))
    assert alone.model is not model and alone.config == model.ctx.config
    for ctx in [*(c.ctx for c in copies), alone, model.ctx]:
        ctx.close()


class _MyContext(offload.ActivationOffload):
    pass


def test_a_context_copied_on_its_own_keeps_its_model_class_and_blocks(nvme_dir, tmp_path):
    """Review: deepcopy(ctx) alone copied the model too, so entering the copy recomputed a
    hidden copy's blocks and the model trained got nothing, silently. A subclass came back
    as ActivationOffload; blocks= given as a generator was spent."""
    torch.manual_seed(0)
    model = _HoldsItsContext()
    ctx = _MyContext(Config.from_env(policy="recompute", tiers="nvme", nvme_dir=nvme_dir,
                                     min_bytes=0), model=model, blocks=iter(model.blocks))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for c in (copy.deepcopy(ctx), copy.copy(ctx), pickle.loads(pickle.dumps(ctx))):
        assert type(c) is _MyContext
        plain = torch.autograd.grad(c.model(x).sum(), list(c.model.parameters()))
        with c:
            ours = torch.autograd.grad(c.model(x).sum(), list(c.model.parameters()))
        assert all(map(torch.equal, plain, ours))
        assert c._schedule.blocks == list(c.model.blocks) and c.stats.nvme_bytes > 0
        c.close()
    assert copy.deepcopy(ctx).model is model and copy.copy(ctx).model is model


@pytest.mark.parametrize("context_first", [True, False])
def test_a_deep_copy_of_a_context_and_its_model_together_is_on_the_copy(context_first,
                                                                       nvme_dir):
    # Review: deepcopy((ctx, model)) met the context first, when the model's copy did not
    # exist yet: the copied context stayed on the original model, and the copied model ran
    # without recompute, silently.
    torch.manual_seed(0)
    model = _HoldsItsContext()
    ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0)
    if context_first:
        c_ctx, c_model = copy.deepcopy((ctx, model))
    else:
        c_model, c_ctx = copy.deepcopy((model, ctx))
    assert c_ctx.model is c_model   # before its first use too
    assert c_ctx._memo is None      # which keeps the deepcopy's originals alive: let go
    cc_ctx, cc_model = copy.deepcopy((c_ctx, c_model))   # a copy of the copy
    assert cc_ctx.model is cc_model
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with c_ctx:
        c_model(x).sum().backward()
    assert c_ctx.model is c_model and c_ctx._schedule.blocks == list(c_model.blocks)
    assert c_ctx.stats.nvme_bytes > 0 and ctx._schedule.blocks == list(model.blocks)
    c_ctx.close()
    ctx.close()


def test_an_unpickled_context_checks_its_settings_at_first_use(tmp_path):
    # Review: a pickled context whose nvme_dir is gone where it is loaded raised a
    # StorageError from the tier; it is the ConfigError a context built there raises.
    gone = tmp_path / "gone"
    gone.mkdir()
    data = pickle.dumps(offload.activations(tiers="nvme", nvme_dir=str(gone)))
    gone.rmdir()
    ctx = pickle.loads(data)
    with pytest.raises(offload.ConfigError, match=r"does not exist"):
        ctx.__enter__()
    assert not ctx.active


def test_exited_while_not_active_never_masks_the_users_exception(caplog):
    ctx = offload.activations(tiers="host")
    with caplog.at_level(logging.ERROR, logger="offload"):
        assert ctx.__exit__(ValueError, ValueError("the user's"), None) is False
    assert "exited while not active" in caplog.text
    with pytest.raises(offload.OffloadError, match="exited while not active"):
        ctx.__exit__(None, None, None)


def test_a_step_while_another_thread_imports_dynamo(monkeypatch):
    """A recompute context's first forward imports torch._dynamo (~1 s); a step entered or
    finished on another thread meanwhile found `torch._dynamo.utils` in sys.modules without
    its `counters` yet: AttributeError at every such step. The half-imported module is put
    in place here by hand."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch._dynamo.utils",
                        types.ModuleType("torch._dynamo.utils"))
    model = torch.nn.Linear(8, 8)
    with offload.activations(policy="offload", tiers="host", min_bytes=0) as ctx:
        model(torch.randn(4, 8)).sum().backward()
    assert ctx.stats.packed_tensors > 0
