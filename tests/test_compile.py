"""torch.compile inside `offload.activations()`: compiled models and compiled blocks train with
gradients bit-exact against the same compiled model without offload, and the context causes
no recompilation (it installs no process-wide module hook, and dynamo does not guard on the
saved-tensor hooks). What gets offloaded under compile: the tensors each compiled graph saves
for its backward (AOTAutograd's partition), through the same hooks as eager tensors.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from schedule_models import SLOW

import offload
from offload.schedule.profile import WHOLE_BLOCK

pytestmark = pytest.mark.slow


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), Block(128), Block(128), nn.Linear(128, 4))


class CountingBackend:
    """Wraps a dynamo backend and counts the graphs it is asked to compile."""

    def __init__(self, name: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(name)
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return self.inner(gm, example_inputs)


def _grads(model, fn, x, seed, ctx_kw=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks with and without offload
    if ctx_kw is None:
        fn(x).pow(2).mean().backward()
        stats = None
    else:
        with offload.activations(model=model, **ctx_kw) as ctx:
            fn(x).pow(2).mean().backward()
        stats = ctx.stats
    return [p.grad.clone() for p in model.parameters()], stats


def _train_and_compare(model, fn, backends, nvme_dir, steps=3, min_bytes=0):
    kw = {"tiers": "nvme", "nvme_dir": nvme_dir, "min_bytes": min_bytes}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The first compiled call happens inside the context (the case that crashed).
        x0 = torch.randn(32, 64)
        ours0, stats0 = _grads(model, fn, x0, 100, kw)
        ref0, _ = _grads(model, fn, x0, 100)
        assert all(torch.equal(a, b) for a, b in zip(ref0, ours0))
        assert stats0.nvme_bytes > 0, "nothing the compiled graph saved was offloaded"
        assert stats0.kept_bytes > 0 or not min_bytes, "nothing stayed as a small save"
        first = [b.compiles for b in backends]
        assert all(n >= 1 for n in first)
        for step in range(steps):
            x = torch.randn(32, 64)
            ref, _ = _grads(model, fn, x, step)
            ours, stats = _grads(model, fn, x, step, kw)
            assert all(torch.equal(a, b) for a, b in zip(ref, ours)), f"step {step}"
            assert stats.nvme_bytes > 0
    assert [b.compiles for b in backends] == first, "offload caused a recompilation"
    hook_warnings = [str(w.message) for w in caught if "hook" in str(w.message).lower()]
    assert hook_warnings == []


# 0: every save moves; 20,000: the 16 KiB activations and smaller stay through the compiled
# core's small-save path (runtime/hooks.py NOTE [Small saves]), the 32 KiB ones move.
@pytest.mark.parametrize("min_bytes", [0, 20_000])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_inside_the_context(backend, min_bytes, nvme_dir):
    model = _model()
    counting = CountingBackend(backend)
    compiled = torch.compile(model, backend=counting)
    _train_and_compare(model, compiled, [counting], nvme_dir, min_bytes=min_bytes)


def test_compiled_blocks_inside_the_context(nvme_dir):
    model = _model()
    backends = []
    for i in (1, 2):
        counting = CountingBackend("aot_eager")
        backends.append(counting)
        model[i] = torch.compile(model[i], backend=counting)
    _train_and_compare(model, model, backends, nvme_dir)


class _FusedQKVAttention(nn.Module):
    """Attention as HF GPT-2 and nanoGPT write it: q, k and v split from one projection."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(d, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_inductor_attention_splitting_one_qkv_output(tiers, nvme_dir):
    """Inductor's forward saves q, k and v as aliases into the qkv buffer with no `_base`
    (untracked: each copied at pack, its elements only), and its backward asserts the
    strides it saved. The copies came back dense and the first backward failed
    (`assert_size_stride`) under offload, recompute and auto for every compiled GPT-2 or
    nanoGPT; they now come back with the saved strides (tensor_meta NOTE [Snapshot
    strides]), bit-exact."""
    def grads(ctx):
        torch.manual_seed(0)
        model = nn.Sequential(_FusedQKVAttention(), _FusedQKVAttention())
        compiled = torch.compile(model, backend="inductor")
        out = []
        for step in range(2):
            x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(step))
            model.zero_grad(set_to_none=True)
            with ctx:
                compiled(x).pow(2).mean().backward()
            out += [p.grad for p in model.parameters()]
        return out

    want = grads(contextlib.nullcontext())
    ctx = offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0)
    got = grads(ctx)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert ctx.stats.offloaded_tensors > 0
    ctx.close()


def test_the_context_installs_no_global_module_hook(nvme_dir):
    from torch.nn.modules import module as nn_module

    before = (dict(nn_module._global_forward_pre_hooks), dict(nn_module._global_forward_hooks))
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        during = (dict(nn_module._global_forward_pre_hooks),
                  dict(nn_module._global_forward_hooks))
    assert during == before


# ---------------------------------------------------------------- recompute / auto


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 128)
        self.blocks = nn.ModuleList(Block(128) for _ in range(2))
        self.out = nn.Linear(128, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).pow(2).mean()


def _train(model, fn, steps, settings=None, after_step=lambda: None):
    """AdamW steps with dropout (seeded per step); the losses and the last context."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, ctx = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        x = torch.randn(32, 64)
        if settings is None:
            loss = fn(x)
            loss.backward()
        else:
            with offload.activations(model=model, **settings) as ctx:
                loss = fn(x)
                loss.backward()
        losses.append(loss.detach())
        opt.step()
        after_step()
    return losses, ctx


@pytest.fixture
def _auto_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recompute_and_auto_on_a_compiled_model_match_it_bit_for_bit(
        backend, policy, nvme_dir, _auto_env, caplog):
    """A compiled model trains under `recompute` / `auto` exactly as the same compiled model
    without offload (dropout included), in one graph: the block wrappers are transparent to
    dynamo (blocks.py NOTE [Wrapping], rule 3), so none of our Python is traced. Before: a
    crash in dynamo (checkpoint with a context_fn, our hooks traced)."""
    import copy
    import logging

    model = Stack()
    reference = copy.deepcopy(model)
    plain, ours = CountingBackend(backend), CountingBackend(backend)
    settings = dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    with caplog.at_level(logging.INFO, logger="offload"):
        got, ctx = _train(model, torch.compile(model, backend=ours), 6, settings)
    want, _ = _train(reference, torch.compile(reference, backend=plain), 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert ours.compiles == plain.compiles == 1
    assert ctx.stats.nvme_bytes > 0
    said = [r.getMessage() for r in caplog.records if "no block ran through offload" in
            r.getMessage()]
    assert len(said) == 1, said   # said once, not per step
    if policy == "auto":
        assert ctx.plan is not None and "no block ran through offload" in str(ctx.plan)
        assert ctx.plan.prediction.recomputed_bytes == 0
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_auto_runs_compiled_blocks_whole(backend, nvme_dir, _auto_env):
    """Blocks compiled one by one: `auto` profiles them without a dispatch mode (which made
    dynamo trace our hooks: a crash) and runs them whole, as they are or checkpointed
    whole (that re-runs the same compiled code: bit-exact); `ctx.plan` says why."""
    import copy

    model = Stack()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for i in range(2):
            m.blocks[i] = torch.compile(m.blocks[i], backend=backend)
    settings = dict(policy="auto", tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    got, ctx = _train(model, model, 6, settings)
    want, _ = _train(reference, reference, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    plan = ctx.plan
    assert plan is not None and "compiled with torch.compile, so run whole" in str(plan)
    # Never per op: one op per block, the whole call (profile.WHOLE_BLOCK); on this slow
    # link with no budget, recomputed (checkpointed whole). Before, a compiled block had no
    # op to recompute: `auto` could only keep or move what it saved.
    assert [[row.op.op_id for row in bp.rows] for bp in plan.blocks.values()] == \
        [[WHOLE_BLOCK]]
    assert all(bp.recompute == {WHOLE_BLOCK} for bp in plan.blocks.values()), str(plan)
    assert "checkpointed whole" in str(plan)
    assert ctx.stats.nvme_bytes > 0
    assert ctx.stats.peak_resident_bytes == plan.prediction.kept_bytes, str(plan)


class RunCounting(CountingBackend):
    """A CountingBackend that also counts the runs of the forward graphs it compiled."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.runs = 0

    def __call__(self, gm, example_inputs):
        compiled = super().__call__(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)
        return run


def _compile_blocks(model, how, backend):
    if how == "block.compile()":   # in place, as torchtune compiles each layer
        for block in model.blocks:
            block.compile(backend=backend)
    elif how == "a compiled dropout inside":   # a compiled function a block calls
        for block in model.blocks:
            block.drop = torch.compile(block.drop, backend=backend)
    else:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()",
                                 "a compiled dropout inside"])
def test_compiled_blocks_are_recomputed_without_recompiling(how, policy, nvme_dir, _auto_env):
    """Blocks compiled one by one, either way, or calling compiled code, under `recompute` /
    `auto`: checkpointed around their compiled call (blocks.py NOTE [Wrapping] rule 5;
    before, an in-place compiled block ran its compiled forward once, not recomputed), with
    no frame compiled after the first step. Before, dynamo traced the generator modes around
    each call (generators.py NOTE [Modes under torch.compile]) and guarded on the RNG
    state's bytes: some 25 frames more, recompiled in later steps until the recompile
    limit. Bit-exact against the same compiled code without offload."""
    import copy
    from torch._dynamo.utils import counters

    torch._dynamo.reset()   # no code compiled by an earlier test (nn.Module._call_impl's)
    model = Stack()
    reference = copy.deepcopy(model)
    ours, plain = RunCounting("aot_eager"), RunCounting("aot_eager")
    _compile_blocks(model, how, ours)
    _compile_blocks(reference, how, plain)
    before = counters["frames"]["total"]
    want, _ = _train(reference, reference, 7)
    plain_frames = counters["frames"]["total"] - before
    frames = []   # the frames dynamo compiled by the end of each step
    settings = dict(policy=policy, tiers="host", min_bytes=0, probe=SLOW)
    frames_at_start = counters["frames"]["total"]
    got, _ = _train(model, model, 7, settings,
                    after_step=lambda: frames.append(counters["frames"]["total"]))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    # Each of the two compiled callables compiles its forward and at most one variant for
    # its re-run (inside backward). `auto` runs a block's compiled code eagerly while it
    # profiles the block under a dispatch mode (dynamo steps aside), so that code may first
    # compile in a later step, as may its re-run's once the plan checkpoints it; none
    # compiles in the last three.
    frames = [n - frames_at_start for n in frames]
    assert frames[-1] <= 2 * 2 and frames[4:] == frames[4:5] * 3, \
        f"frames compiled by the end of each step: {frames} (without offload: {plain_frames})"
    assert plain.runs == 2 * 7   # two blocks, seven steps
    if policy == "recompute":
        assert ours.runs == 2 * plain.runs, "a compiled block was not re-run in backward"
    for block in model.blocks:   # exit put back what entry found (blocks.py rule 2)
        assert not hasattr(block.__dict__.get("forward"), "_offload_run")
        compiled = block.__dict__.get("_compiled_call_impl")
        assert (compiled is not None) == (how == "block.compile()")
        assert not hasattr(compiled, "_offload_run")


@pytest.mark.parametrize("given", ["model.blocks", "list(model.blocks)", "a predicate",
                                   "the modules compiled", "one of them"])
def test_compiled_blocks_named_by_blocks_are_recomputed(given, nvme_dir):
    """`blocks=` naming blocks compiled one by one (the ModuleList holding them, a list of
    them, a predicate matching the compiled module, the modules as they were before
    compiling): a torch.compile wrapper's class has no forward, so it was taken for a
    container and its inner module, which runs inside dynamo's trace, for the block:
    nothing was re-run (4x the saved bytes; helpers' reports). They are re-run as the
    detected ones are."""
    from offload.schedule.blocks import find_blocks

    model = Stack()
    originals = list(model.blocks)
    for i, block in enumerate(originals):
        model.blocks[i] = torch.compile(block, backend="eager")
    blocks = {"model.blocks": model.blocks, "list(model.blocks)": list(model.blocks),
              "a predicate": lambda m: isinstance(m, Block), "the modules compiled": originals,
              "one of them": originals[0]}[given]
    # (One block: saves what its wrapper named does.)
    reference = model.blocks[0] if given == "one of them" else None
    wrappers = [reference] if reference is not None else list(model.blocks)
    assert [b is c for b, c in zip(find_blocks(model, blocks), wrappers)] == [True] * len(wrappers)
    saved = {}
    for name, chosen in (("detected", reference), (given, blocks)):
        torch.manual_seed(0)
        with offload.activations(model=model, blocks=chosen, policy="recompute",
                                 tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
            model(torch.randn(32, 64)).backward()
        saved[name] = ctx.stats.saved_bytes
    assert saved[given] == saved["detected"] > 0


class HeadKept(nn.Module):
    """A forward that keeps its first layer's saves (`no_offload()` around it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x):
        with offload.no_offload():
            h = torch.relu(self.a(x))
        return self.b(h).mean()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_no_offload_inside_a_compiled_forward(backend):
    """`no_offload()` inside compiled code: dynamo traced its depth, which changed after
    the graph (the region kept nothing) and failed its guard at the second call ("Guard
    failed on the same frame it was created", with or without a context; a helper's
    report). Now the graph ends at the region (no_offload.py NOTE [no_offload under
    torch.compile]): it keeps what it keeps uncompiled, gradients bit-exact against the
    compiled model without offload; under fullgraph=True dynamo refuses, saying why."""
    eager = HeadKept()
    compiled = torch.compile(HeadKept(), backend=backend)
    x = torch.randn(8, 16)
    for _ in range(2):   # no context: the second call failed
        compiled(x).backward()
    kept = {}
    for name, model, fn in (("eager", eager, eager), ("compiled", compiled._orig_mod, compiled)):
        for step in range(3):
            model.zero_grad(set_to_none=True)
            fn(x).backward()
            want = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            with offload.activations(model=model, tiers="host", min_bytes=0) as ctx:
                fn(x).backward()
            assert all(torch.equal(a, p.grad) for a, p in zip(want, model.parameters()))
            kept.setdefault(name, []).append((ctx.stats.kept_bytes, ctx.stats.host_bytes))
    assert kept["compiled"] == kept["eager"] and kept["eager"][0][0] > 0
    torch._dynamo.reset()   # (else dynamo finds the code compiled above and says only that)
    with pytest.raises(Exception, match="put it around the compiled call instead"):
        torch.compile(HeadKept(), backend=backend, fullgraph=True)(x)


# ---------------------------------------------------------------- eager parts of a compiled model
class Recurrent(nn.Module):
    """Linear → a 2-layer RNN → Linear: dynamo does not trace nn.GRU / nn.LSTM, so the RNN
    runs eagerly inside the compiled call, with dynamo's frame evaluator installed."""

    def __init__(self, kind) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.rnn = kind(32, 32, num_layers=2, batch_first=True)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.rnn(torch.relu(self.inp(x)))[0]).pow(2).mean()


@pytest.mark.parametrize("kind, tiers", [(nn.GRU, "nvme"), (nn.LSTM, "host")])
def test_an_rnn_in_a_compiled_model_saves_through_the_hooks_as_python(kind, tiers, nvme_dir):
    """The RNN's saves reach our hooks while dynamo's frame evaluator is installed; the
    hooks, the records and the tiers run as Python, not compiled (util/never_compiled.py
    NOTE [Never compiled]). Before: dynamo compiled the hooks per save and raised "Cannot
    call numel() on tensor with symbolic sizes/strides" once the lengths varied. Gradients
    bit-exact against the same compiled model without offload, at a new length each step."""
    from offload.util.never_compiled import marks_available

    assert marks_available(), "this torch has no dynamo frame marks: the hooks get compiled"
    model = Recurrent(kind)
    compiled = torch.compile(model, backend="aot_eager")
    kw = {"tiers": tiers, "nvme_dir": nvme_dir, "min_bytes": 0}
    for step in range(4):
        x = torch.randn(4, 5 + 3 * step, 16)
        ref, _ = _grads(model, compiled, x, step)
        ours, stats = _grads(model, compiled, x, step, kw)
        assert all(torch.equal(a, b) for a, b in zip(ref, ours)), f"step {step}"
        assert getattr(stats, f"{tiers}_bytes") > 0, "the RNN's saves were not offloaded"


def test_a_compiled_training_step_with_its_backward_inside(nvme_dir):
    """`loss.backward()` inside the compiled function: the unpacks, the backward's marks
    and the step's end run under dynamo's frame evaluator too (NOTE [Never compiled])."""
    model = Recurrent(nn.GRU)

    def train_step(x):
        loss = model(x)
        loss.backward()
        return loss.detach()

    compiled = torch.compile(train_step, backend="aot_eager")
    for step in range(3):
        x = torch.randn(4, 5 + 2 * step, 16)
        model.zero_grad(set_to_none=True)
        train_step(x)
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                                 model=model) as ctx:
            compiled(x)
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters())), step
        assert ctx.stats.nvme_bytes > 0


class KeywordBlock(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.lin, self.lin2, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.2)

    def forward(self, x, *, mask=None, scale=None):
        return x + self.lin2(self.drop(torch.tanh(self.lin(x)) * mask * scale))


class KeywordStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(KeywordBlock() for _ in range(3))
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x, mask):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, mask=mask, scale=self.scale)
        return x.pow(2).mean()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()"])
def test_a_compiled_block_reruns_the_compiled_code_its_forward_ran(how, policy, nvme_dir,
                                                                    _auto_env):
    """A re-run must run the compiled variant its forward ran, or its saves do not match:
    torch's CheckpointError ("Recomputed values ... have different metadata") in backward.
    Dynamo guards on the function modes on the stack and on the arguments' types: the
    forward ran under our generator modes and the re-run under none, and a parameter handed
    as a keyword (`scale=self.scale`) came back to the re-run as a plain tensor. Here each
    step calls the model in eval() and then in train() before one backward, at a length
    that alternates (before: recompute failed at step 1, auto at step 5). Bit-exact against
    the same compiled blocks without offload."""
    import copy

    model = KeywordStack()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        _compile_blocks(m, how, "aot_eager")
    settings = dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    for step in range(8):
        length = 16 + 8 * (step % 2)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, length, 8, generator=g)
        mask = (torch.rand(4, length, 1, generator=g) > 0.2).float()
        grads = []
        for m, ctx in ((reference, None), (model, offload.activations(model=model, **settings))):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            with ctx if ctx is not None else contextlib.nullcontext():
                m.eval()
                consistency = m(x, mask)
                m.train()
                (m(x + 1, mask) + 0.3 * consistency).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), f"step {step}"
