"""Context lifecycle (issue 10 items 6-8): contexts exited out of order, end-of-step work at a
defined point (step.py NOTE [End of step]), one exception class for "used after close",
nothing kept alive by a graph dropped without backward, tensors saved during backward left
where they are, and torch.func's refusal explained.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import re
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.runtime import step as step_module
from offload.errors import OffloadError, UsedAfterCloseError

_autograd = torch._C._autograd


def _hook_stack_empty() -> bool:
    return _autograd._top_saved_tensors_default_hooks(True) is None


def _nvme(nvme_dir, **kw):
    return offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, **kw)


# ---------------------------------------------------------------- exits out of order
def test_contexts_exited_out_of_order_keep_the_right_hooks(nvme_dir):
    x = torch.randn(256, 256, requires_grad=True)
    a, b = _nvme(nvme_dir), _nvme(nvme_dir)
    a.__enter__()
    ya = (x * 2).tanh().sum()
    b.__enter__()
    yb = (x * 3).tanh().sum()
    a.__exit__(None, None, None)                   # the first one entered leaves first
    packed_b = b.stats.packed_tensors
    yc = (x * 4).tanh().sum()                      # must go to b, the one still active
    assert b.stats.packed_tensors > packed_b
    b.__exit__(None, None, None)
    assert _hook_stack_empty()
    (ya + yb + yc).backward()
    x_ref = x.detach().clone().requires_grad_()
    ((x_ref * 2).tanh().sum() + (x_ref * 3).tanh().sum() + (x_ref * 4).tanh().sum()).backward()
    assert torch.equal(x.grad, x_ref.grad)
    with _nvme(nvme_dir) as c:                     # the next step works (no closed tier)
        (x * 5).tanh().sum().backward()
    assert c.stats.nvme_written_bytes > 0


def test_exit_under_someone_elses_hooks_takes_off_its_own_and_leaves_theirs(nvme_dir):
    """A user's `saved_tensors_hooks` entered inside the block and left entered (an
    ExitStack closed later): the exit used to raise and leave offload's hooks installed, so
    every later step without offload still packed into the closed context."""
    x = torch.randn(64, 64, requires_grad=True)
    ctx = _nvme(nvme_dir)
    seen = []
    theirs = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t)
    with ctx:
        theirs.__enter__()
    assert not ctx.active
    (x * 2).tanh().sum().backward()                # still under the user's hooks only
    assert seen and ctx.stats.packed_tensors == 0
    theirs.__exit__(None, None, None)
    assert _hook_stack_empty()
    packed = ctx.stats.packed_tensors
    (x * 3).tanh().sum().backward()                # no hooks: nothing reaches offload
    assert ctx.stats.packed_tensors == packed
    with ctx:                                      # and the context is entered again
        (x * 4).tanh().sum().backward()
    assert ctx.stats.nvme_written_bytes > 0 and _hook_stack_empty()


def test_exit_on_another_thread_raises_and_leaves_both_threads_clean(nvme_dir):
    """A training step written as a generator, resumed on a worker thread for its backward
    and exit. Before: the exit raised and changed nothing, so the context stayed active for
    good (`close()` did not help) and its hooks stayed on the entering thread: later plain
    steps there packed into the ended step, or raised UsedAfterCloseError once it was
    closed. A thread cannot reach another's hook stack: the hooks retire there."""
    x = torch.randn(64, 64, requires_grad=True)
    plain = [torch.autograd.grad((x * k).tanh().sum(), x)[0] for k in (2, 3)]
    ctx = _nvme(nvme_dir)
    ctx.__enter__()
    loss = (x * 2).tanh().sum()
    errors = []

    def resume():
        loss.backward()
        _catch(errors, ctx.__exit__, None, None, None)

    worker = threading.Thread(target=resume, name="resumer")
    worker.start()
    worker.join()
    assert re.search(r"exited on thread \d+ \(resumer\), not on thread \d+, which entered it",
                     str(errors[0])), errors
    assert not ctx.active and ctx.stats.nvme_written_bytes > 0
    assert torch.equal(x.grad, plain[0])
    ctx.close()
    offload.empty_cache()
    packed = ctx.stats.packed_tensors
    x.grad = None
    assert not _hook_stack_empty()      # the retired entry, until a save meets it ...
    (x * 3).tanh().sum().backward()    # a plain step on the entering thread
    assert torch.equal(x.grad, plain[1]) and ctx.stats.packed_tensors == packed
    assert _hook_stack_empty()          # ... which takes it off
    with pytest.raises(OffloadError, match=r"exited while not active"):
        ctx.__exit__(None, None, None)
    with ctx:
        (x * 4).tanh().sum().backward()
    assert ctx.stats.nvme_written_bytes > 0 and _hook_stack_empty()


def test_an_outer_context_gets_its_saves_back_after_an_inner_one_exited_elsewhere(nvme_dir):
    """The inner context's retired hooks sat on top of the outer's: the outer moved nothing
    more in its step. The first save that meets them takes them off."""
    x = torch.randn(64, 64, requires_grad=True)
    outer, inner = _nvme(nvme_dir), _nvme(nvme_dir)
    with outer:
        inner.__enter__()
        first = (x * 2).tanh().sum()
        worker = threading.Thread(target=lambda: _catch([], inner.__exit__, None, None, None))
        worker.start()
        worker.join()
        packed = outer.stats.packed_tensors
        second = (x * 3).tanh().sum()   # its first save meets the retired entry
        third = (x * 4).tanh().sum()
        assert outer.stats.packed_tensors > packed
        (first + second + third).backward()
    y = x.detach().clone().requires_grad_()
    plain, = torch.autograd.grad(sum((y * k).tanh().sum() for k in (2, 3, 4)), y)
    assert torch.equal(x.grad, plain)
    assert _hook_stack_empty() and not inner.active and not outer.active


def test_exit_on_another_thread_with_an_exception_says_so_and_reraises_the_users(nvme_dir,
                                                                                   caplog):
    ctx = _nvme(nvme_dir)
    ctx.__enter__()
    errors = []

    def fail():
        try:
            with contextlib.ExitStack() as stack:
                stack.push(ctx)
                raise ValueError("the user's")
        except ValueError as exc:
            errors.append(exc)

    with caplog.at_level(logging.ERROR, logger="offload"):
        worker = threading.Thread(target=fail)
        worker.start()
        worker.join()
    assert [str(e) for e in errors] == ["the user's"] and not ctx.active
    assert any("exited on thread" in r.getMessage() for r in caplog.records)
    with ctx:
        pass
    assert _hook_stack_empty()


def test_a_context_active_on_one_thread_refused_on_another_says_so(nvme_dir):
    # Was: "already active; create one context per step or nest different ones", advice for
    # one thread that does not help a worker sharing the context.
    ctx = _nvme(nvme_dir)
    errors = []
    with ctx:
        worker = threading.Thread(target=lambda: _catch(errors, ctx.__enter__))
        worker.start()
        worker.join()
        with pytest.raises(OffloadError, match=r"already active \(entered and not exited yet\); "
                           r"exit it before entering it again"):
            ctx.__enter__()
    assert str(errors[0]) == ("offload.activations(): this context is active on another "
                              "thread; a context belongs to one thread at a time (saved-tensor "
                              "hooks are per thread): build one context per thread")
    assert _hook_stack_empty()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


# ---------------------------------------------------------------- end of step
@pytest.fixture
def finish_calls(monkeypatch):
    """Every Step.finish call, with whether a destructor was on the stack."""
    calls = []
    original = step_module.Step.finish

    def spy(self, end_s, **kwargs):
        frames = [f.function for f in inspect.stack()]
        calls.append({"in_del": "__del__" in frames, "thread": threading.current_thread()})
        return original(self, end_s, **kwargs)

    monkeypatch.setattr(step_module.Step, "finish", spy)
    return calls


def test_backward_after_the_block_ends_the_step_at_the_end_of_backward(nvme_dir, finish_calls):
    x = torch.randn(256, 256, requires_grad=True)
    with _nvme(nvme_dir) as ctx:
        y = (x @ x).tanh().sum()
    assert finish_calls == [] and not ctx.tiers["nvme"].closed
    y.backward()
    # Autograd's end-of-backward callback ran the end of the step, before backward returned.
    assert len(finish_calls) == 1 and not finish_calls[0]["in_del"]
    assert ctx.tiers["nvme"].closed and ctx.stats.exit_nvme_used_bytes == 0


def test_a_graph_dropped_after_the_block_ends_at_the_next_entry(nvme_dir, finish_calls):
    x = torch.randn(256, 256, requires_grad=True)
    with _nvme(nvme_dir) as first:
        y = (x @ x).tanh().sum()
    del y
    gc.collect()
    # The last saved tensor died in a destructor: nothing ran there.
    assert finish_calls == [] and not first.tiers["nvme"].closed
    with _nvme(nvme_dir) as second:
        assert first.tiers["nvme"].closed            # finished at this entry
        (x * 2).sin().sum().backward()
    assert [c["in_del"] for c in finish_calls] == [False, False]
    assert second.stats.nvme_written_bytes > 0


def test_empty_cache_ends_pending_steps_and_closes_their_store(nvme_dir):
    from offload.tiers import nvme_space

    x = torch.randn(256, 256, requires_grad=True)
    with _nvme(nvme_dir) as ctx:
        y = (x @ x).tanh().sum()
    del y
    gc.collect()
    offload.empty_cache()
    assert ctx.tiers["nvme"].closed
    assert not [k for k in nvme_space.open_stores() if nvme_dir in k[0]]


def test_close_frees_every_step_of_the_context(nvme_dir):
    from offload.tiers import nvme_space

    x = torch.randn(256, 256, requires_grad=True)
    ctx = _nvme(nvme_dir)
    graphs, tiers = [], []
    for _ in range(2):                             # two steps whose graphs are still alive
        with ctx:
            graphs.append((x * 2).tanh().sum())
        tiers.append(ctx.tiers["nvme"])
    assert not any(t.closed for t in tiers)
    ctx.close()
    assert all(t.closed for t in tiers)
    assert not [k for k in nvme_space.open_stores() if nvme_dir in k[0]]  # no slab left
    with pytest.raises(UsedAfterCloseError):
        graphs[0].backward()


def test_two_micro_batches_in_one_block_keep_the_tiers_open(nvme_dir):
    """A backward inside the block must not end the step: another forward may follow."""
    x = torch.randn(256, 256, requires_grad=True)
    with _nvme(nvme_dir) as ctx:
        (x * 2).tanh().sum().backward()
        (x * 3).tanh().sum().backward()
    assert ctx.stats.nvme_written_bytes > 0 and ctx.tiers["nvme"].closed


# ---------------------------------------------------------------- graphs without backward
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_a_graph_dropped_without_backward_frees_every_record(tiers, nvme_dir):
    """tanh saves its own output: holding that tensor in the hooks would tie a cycle through
    autograd's C++ node that the garbage collector cannot break (records kept forever)."""
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
        y = (x * 2).tanh().exp().sum()
        assert ctx._hooks.ledger.live_records > 0
    del y
    gc.collect()
    assert ctx._hooks.ledger.live_records == 0


# ---------------------------------------------------------------- used after close
def test_a_save_after_close_inside_the_block_says_what_closed_it(nvme_dir):
    """ctx.close() inside the block, then more forward: the error said only "nvme tier used
    after close", not what closed it nor what to do (the core's move path and the tier's
    store say the same)."""
    x = torch.randn(64, 64, requires_grad=True)
    ctx = _nvme(nvme_dir)
    with pytest.raises(UsedAfterCloseError, match=r"close\(\) ran inside its block.*call "
                                                  r"ctx.close\(\) after the block"):
        with ctx:
            h = (x * 2).tanh()
            ctx.close()
            (h * 3).tanh().sum().backward()
    with ctx:                                      # the next step works
        (x * 3).tanh().sum().backward()


def test_close_inside_the_block_keeps_what_it_freed_in_the_figures(nvme_dir):
    """ctx.close() inside the block notes what the step still held (exit_*_used_bytes);
    the block's exit on the backward's UsedAfterCloseError aborted the step again and set
    them to the freed tiers' 0 (a helper's find)."""
    x = torch.randn(256, 256, requires_grad=True)
    ctx = offload.activations(tiers="host,nvme", host_bytes="256KiB", nvme_dir=nvme_dir,
                              min_bytes=0)
    with pytest.raises(UsedAfterCloseError):
        with ctx:
            loss = (x * 2).tanh().exp().sum()
            ctx.close()
            held = (ctx.stats.exit_host_used_bytes, ctx.stats.exit_nvme_used_bytes)
            loss.backward()
    assert held[0] > 0 and held[1] > 0, held
    assert (ctx.stats.exit_host_used_bytes, ctx.stats.exit_nvme_used_bytes) == held


def test_used_after_close_is_one_exception_class(nvme_dir):
    x = torch.randn(256, 256, requires_grad=True)
    ctx = _nvme(nvme_dir)
    with ctx:
        y = (x @ x).tanh().sum()
    ctx.close()                                    # frees the tiers under the live graph
    with pytest.raises(UsedAfterCloseError, match="released it"):
        y.backward()
    core = pytest.importorskip("offload._C")
    store = core.NvmeStore([nvme_dir], 1 << 20)
    store.close()
    with pytest.raises(UsedAfterCloseError, match="NvmeStore is closed"):
        store.allocate(4096)
    arena = core.HostArena(4096, pinned=False)
    block = arena.allocate(16)
    block.release()
    with pytest.raises(UsedAfterCloseError, match="HostBlock was released"):
        memoryview(block)
    assert issubclass(UsedAfterCloseError, RuntimeError)


# ---------------------------------------------------------------- saved during backward
def _checkpointed_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(3)])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_tensors_saved_during_backward_stay(use_reentrant, nvme_dir):
    """Reentrant checkpointing re-runs the forward inside backward: what that saves is used
    at once, so it is kept, not written out and read straight back."""
    model = _checkpointed_model()
    x = torch.randn(128, 256, requires_grad=True)

    def run(ctx):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            h = x
            for block in model:
                h = checkpoint(block, h, use_reentrant=use_reentrant)
            h.sum().backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    import contextlib

    ref = run(contextlib.nullcontext())
    ctx = _nvme(nvme_dir)
    ours = run(ctx)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    s = ctx.stats
    # What went to disk is what the forward saved: the inputs of blocks 2 and 3 (x is a leaf
    # that needs grad: never moved). Nothing the recompute saved during backward.
    block_input = 128 * 256 * 4
    assert s.nvme_bytes == s.nvme_written_bytes == s.nvme_read_bytes == 2 * block_input
    if use_reentrant:
        # Each block's recompute saves its Tanh output (its Linear's input there is a fresh
        # leaf that needs grad: a parameter-like tensor, never moved).
        assert s.backward_kept_bytes == 3 * block_input


# ---------------------------------------------------------------- torch.func
def test_torch_func_inside_the_context_says_what_to_do():
    def f(x):
        return (x.sin() * x).sum()

    x = torch.randn(1000)
    with pytest.raises(RuntimeError) as info:
        with offload.activations(tiers="host"):
            torch.func.grad(f)(x)
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "don't yet support saved tensor hooks" in str(info.value)   # torch's own error
    assert "Call the transform outside the `with offload.activations()` block" in notes
    with pytest.raises(RuntimeError) as info:   # where users try next: said there too
        with offload.activations(tiers="host"), offload.no_offload():
            torch.func.grad(f)(x)
    assert "offload.no_offload() does not help" in "\n".join(info.value.__notes__)
    torch.testing.assert_close(torch.func.grad(f)(x), x.cos() * x + x.sin())  # outside: works
    assert _hook_stack_empty()


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_hooks_on_one_saved_tensor_inside_the_context_say_what_to_do(policy, nvme_dir):
    """`grad_fn._raw_saved_result.register_hooks` (torch's per-saved-tensor hooks) raises
    torch's bare "hooks have already been set" inside the block, since every save there is
    packed with the context's hooks: the error says why and what to do instead."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    for region in (contextlib.nullcontext, offload.no_offload):
        with pytest.raises(RuntimeError) as info:
            with offload.activations(model=model, policy=policy, tiers="nvme",
                                     nvme_dir=nvme_dir, min_bytes=0), region():
                e = torch.exp(model(x))
                e.grad_fn._raw_saved_result.register_hooks(lambda t: t, lambda t: t)
        assert "hooks have already been set" in str(info.value)   # torch's own error
        notes = "\n".join(info.value.__notes__)
        assert "saved inside offload.activations()" in notes and "no_offload() does not help" \
            in notes
    # What the note offers instead: the user's hooks around the save, inside the block.
    calls = []
    with offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                             min_bytes=0):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: calls.append(1) or t,
                                                      lambda t: t):
            e = torch.exp(model(x))
        e.sum().backward()
    assert calls and not os.listdir(nvme_dir) and _hook_stack_empty()


class _WritesIntoItsSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = torch.sigmoid(self.l1(x))   # sigmoid and l2 save y ...
        out = self.l2(y)
        y.mul_(2)                       # ... which allow_mutation_on_saved_tensors permits
        return out + self.l2(y)


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_allow_mutation_on_saved_tensors_is_refused_around_and_exact_inside(policy, nvme_dir):
    """Entered inside torch's allow_mutation_on_saved_tensors(), our hooks hid every save
    from its clone-before-write hooks: offload and auto raised autograd's in-place error
    where plain autograd runs, and recompute's re-run gave a silently wrong gradient."""
    from torch.autograd.graph import allow_mutation_on_saved_tensors
    torch.manual_seed(0)
    model = nn.Sequential(_WritesIntoItsSave(), _WritesIntoItsSave())
    x = torch.randn(4, 8)
    with allow_mutation_on_saved_tensors():
        model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    ctx = _nvme(nvme_dir, model=model, policy=policy)
    model.zero_grad()
    with allow_mutation_on_saved_tensors():
        with pytest.raises(offload.OffloadError, match="Enter allow_mutation_on_saved_tensors"
                           r"\(\) inside the offload context"):
            with ctx:
                pass
    assert not ctx.active and _hook_stack_empty()
    for _ in range(4):   # inside ours: torch's hooks are innermost, its region as without us
        model.zero_grad()
        with ctx:
            with allow_mutation_on_saved_tensors():
                model(x).square().mean().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


# ---------------------------------------------------------------- interrupted enters
class _InterruptAfterRelease:
    """context._CLAIM whose release is followed by a KeyboardInterrupt: where a Ctrl-C's
    handler runs when it lands while the lock is held."""

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc):
        self.lock.__exit__(*exc)
        raise KeyboardInterrupt


def _interrupted_then_exact(ctx, interrupt, monkeypatch, x):
    with monkeypatch.context() as patch:
        interrupt(patch)
        with pytest.raises(KeyboardInterrupt):
            with ctx:
                (x * 2).tanh().sum().backward()
    assert not ctx.active and _hook_stack_empty()
    x.grad = None
    with ctx:                                      # the context is usable again
        (x * 3).tanh().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (x_ref * 3).tanh().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def _raise_at(patch, owner, name, after=False):
    """`owner.name` raises KeyboardInterrupt the first time it is called, as a Ctrl-C
    landing at that function's first line does (`after`: at its last, once it ran)."""
    real, fired = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if fired:
            return real(*args, **kwargs)
        fired.append(1)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt
    patch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("where", ["step-end-checks", "tier-close", "copies-before-close",
                                   "tier-open", "tier-figures"])
def test_an_interrupt_while_the_nvme_tier_opens_or_closes_gives_its_store_back(
        where, nvme_dir, monkeypatch):
    """Before: a Ctrl-C in the step's end (before its tiers closed), in the nvme tier's
    close (after it counted itself closed) or in its opening (between acquiring the store
    and its `try`) left the process's store counted as in use for good: `empty_cache()`
    could not close it (its slab file, I/O threads and disk reservation stayed), and later
    contexts with other settings were handed it."""
    from offload.tiers import heap, nvme, nvme_space
    from offload.util.stats import Stats

    # (the heap settings' release runs, then the interrupt: one landing on its first line
    # would leave them set, as any cleanup interrupted before it starts)
    owner, name = {"step-end-checks": (step_module, "check_graph_depth"),
                   "tier-close": (heap.HeapSettings, "release"),
                   "copies-before-close": (step_module.Step, "close_copies"),
                   "tier-open": (nvme.nvme_space, "capacity_source"),
                   "tier-figures": (Stats, "tier")}[where]
    x = torch.randn(64, 64, requires_grad=True)
    ctx = _nvme(nvme_dir)
    with ctx:
        (x * 2).tanh().sum().backward()             # opened once: the store is pooled
    _interrupted_then_exact(ctx, lambda patch: _raise_at(patch, owner, name,
                                                         after=where == "tier-close"),
                            monkeypatch, x)
    offload.empty_cache()
    assert nvme_space.open_stores() == {} and not heap.HeapSettings.active()
    assert not os.listdir(nvme_dir) or all(not f.startswith("offload") for f in
                                           os.listdir(nvme_dir))


def test_an_interrupt_after_the_claim_leaves_the_context_usable(nvme_dir, monkeypatch):
    """A Ctrl-C between the claim and the `try` left the context active for good: every
    later `with ctx:` said it was already active."""
    from offload import context as context_mod
    x = torch.randn(64, 64, requires_grad=True)
    _interrupted_then_exact(
        _nvme(nvme_dir),
        lambda patch: patch.setattr(context_mod, "_CLAIM",
                                    _InterruptAfterRelease(context_mod._CLAIM)),
        monkeypatch, x)


def test_an_interrupt_after_the_hooks_are_pushed_leaves_none(nvme_dir, monkeypatch):
    """A Ctrl-C right after the push left the aborted step's hooks on the thread: later
    plain steps went through them to a closed tier (UsedAfterCloseError on nvme)."""
    from offload.runtime import hook_stack

    def push_then_interrupt(patch):
        real = hook_stack.install

        def install(hooks):
            real(hooks)
            raise KeyboardInterrupt
        patch.setattr(hook_stack, "install", install)

    x = torch.randn(64, 64, requires_grad=True)
    _interrupted_then_exact(_nvme(nvme_dir), push_then_interrupt, monkeypatch, x)


def test_an_interrupt_while_blocks_are_wrapped_leaves_none_wrapped(nvme_dir, monkeypatch):
    """A Ctrl-C half-way through wrapping left block 0 wrapped through every later step
    and context."""
    from offload.schedule import blocks as blocks_mod
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])

    def interrupt_at_the_second(patch):
        real, calls = blocks_mod._wrapper, []

        def wrapper(*args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args)
        patch.setattr(blocks_mod, "_wrapper", wrapper)

    ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0)
    with monkeypatch.context() as patch:
        interrupt_at_the_second(patch)
        with pytest.raises(KeyboardInterrupt):
            with ctx:
                pass
    assert not ctx.active and _hook_stack_empty()
    assert not any("forward" in block.__dict__ for block in model)


class _InterruptingSteps(weakref.WeakSet):
    """A context's set of steps whose next `add` (the last line of an enter, right after
    the hooks are pushed) is a Ctrl-C."""

    armed = False

    def add(self, item):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        super().add(item)


def test_an_interrupt_at_the_end_of_an_enter_leaves_the_previous_step_alone(nvme_dir):
    """The enter's own handler put the previous step back but left the context marked
    installed, and the handler around it then freed that previous step as an interrupted
    exit: its later backward raised UsedAfterCloseError (and a first entry an
    AttributeError in place of the KeyboardInterrupt). Found by a review."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ctx = _nvme(nvme_dir, model=model)
    ctx._steps = steps = _InterruptingSteps()
    steps.armed = True
    with pytest.raises(KeyboardInterrupt):   # a first entry
        with ctx:
            pass
    with ctx:
        loss = model(x).sum()
    steps.armed = True
    with pytest.raises(KeyboardInterrupt):   # an entry while the step before awaits backward
        with ctx:
            pass
    assert not ctx.active and _hook_stack_empty()
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


# ---------------------------------------------------------------- interrupted exits
def _interrupt_removal_at_entry(patch):
    from offload.runtime import hook_stack

    def remove(hooks, thread):
        raise KeyboardInterrupt
    patch.setattr(hook_stack, "remove", remove)


def _interrupt_removal_after_it(patch):
    from offload.runtime import hook_stack
    real = hook_stack.remove

    def remove(hooks, thread):
        real(hooks, thread)
        raise KeyboardInterrupt
    patch.setattr(hook_stack, "remove", remove)


def _interrupt_unwrapping_half_way(patch):
    from offload.schedule import blocks as blocks_mod
    real, calls = blocks_mod._retire, []

    def retire(value):
        calls.append(1)
        if len(calls) == 3:   # the second block's (two wrapped attributes each)
            raise KeyboardInterrupt
        return real(value)
    patch.setattr(blocks_mod, "_retire", retire)


@pytest.mark.parametrize("interrupt", [_interrupt_removal_at_entry, _interrupt_removal_after_it,
                                       _interrupt_unwrapping_half_way],
                         ids=["taking-hooks-off", "after-hooks-off", "unwrapping-blocks"])
@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-in", "backward-after"])
def test_an_interrupt_inside_an_exit_finishes_it(interrupt, backward_inside, nvme_dir,
                                                 monkeypatch):
    """context.py NOTE [An interrupted exit]: a Ctrl-C while the exit took the hooks off or
    unwrapped the blocks (a real SIGINT did, once in ~300 random interrupts) left the
    context active for good ("already active" at every later `with ctx:`), its hooks on the
    thread (later plain steps packed into the ended step's nvme tier) and blocks wrapped."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
    x = torch.randn(8, 64)
    ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0)

    def step():
        model.zero_grad()
        with ctx:
            loss = model(x).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    step()
    with monkeypatch.context() as patch:
        interrupt(patch)
        with pytest.raises(KeyboardInterrupt):
            step()
    assert not ctx.active and _hook_stack_empty()
    assert not any("forward" in block.__dict__ for block in model)
    model.zero_grad()
    model(x).sum().backward()                     # a plain step: nothing of ours in it
    plain = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(step(), plain))
    assert os.listdir(nvme_dir) == []


def test_a_context_says_what_it_is(nvme_dir):
    """repr(ctx) was `<offload.context.ActivationOffload object at 0x...>`."""
    model = nn.Linear(4, 4)
    ctx = offload.activations(model=model, policy="offload", tiers="host,nvme",
                              nvme_dir=nvme_dir)
    assert repr(ctx) == (f"<offload.activations policy=offload tiers=host,nvme "
                         f"nvme_dir={nvme_dir} model=Linear>")
    with ctx:
        assert repr(ctx).endswith(" active>")
    assert repr(offload.activations(enabled=False)) == "<offload.activations disabled>"
