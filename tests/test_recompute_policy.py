"""Block detection and OFFLOAD_POLICY=recompute: checkpoint every detected block while the
context is active, inputs through the tiers, bit-exact, never wrapping a user's
checkpointed block twice."""
from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
from schedule_models import compare_steps, hf_gpt2, hf_llama, small_gpt

import offload
from offload.errors import ConfigError
from offload.bench.models import MLP, ConvNet
from offload.schedule import auto_session, recompute as recompute_mod, recompute_session
from offload.schedule.blocks import BlockWrappers, find_blocks



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: with two OpenMP threads on a busy 2-core machine a step takes 15x longer
    (spinning threads), and these tests run hundreds of steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ---------------------------------------------------------------- detection
def test_finds_the_repeated_layers():
    model, _ = small_gpt(layers=3)
    assert find_blocks(model) == list(model.blocks)


def test_mixed_sequentials_are_not_blocks():
    assert find_blocks(MLP()) == []          # Linear, ReLU, Linear, ...
    assert find_blocks(ConvNet()) == []
    assert find_blocks(None) == []


def test_a_stack_of_parametrized_layers_is_a_stack():
    """weight_norm / spectral_norm / orthogonal make each layer an instance of a class of its
    own: the stack was not found (two small heads were checkpointed instead of the trunk,
    and with no other stack `recompute` raised that blocks must be of one layer class)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
            self.heads = nn.ModuleList(nn.Linear(64, 1) for _ in range(2))

    net = Net()
    for layer in net.layers:
        torch.nn.utils.parametrizations.weight_norm(layer)
    assert len({type(layer) for layer in net.layers}) == 6
    assert find_blocks(net) == list(net.layers)


def test_an_outer_stack_shadows_inner_ones_and_small_stacks_do_not_count():
    inner = lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # noqa: E731

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = inner()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))
            self.tiny = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    net = Net()
    assert find_blocks(net) == list(net.layers)


def test_hugging_face_layouts_are_found_without_configuration():
    gpt2, _ = hf_gpt2()
    llama, _ = hf_llama()
    assert find_blocks(gpt2) == list(gpt2.transformer.h)
    assert find_blocks(llama) == list(llama.model.layers)


def test_blocks_argument_modules_or_predicate():
    model, _ = small_gpt(layers=3)
    assert find_blocks(model, [model.blocks[1]]) == [model.blocks[1]]
    assert find_blocks(model, model.blocks[0]) == [model.blocks[0]]
    mlps = find_blocks(model, lambda m: isinstance(m, nn.Sequential))
    assert mlps == [b.mlp for b in model.blocks]


def test_a_container_given_as_blocks_stands_for_its_members():
    """`blocks=model.blocks` (the ModuleList itself), or a predicate matching it: a
    ModuleList's forward is never called, so before nothing was checkpointed, silently
    (only an INFO line, blaming torch.compile)."""
    model, loss_fn = small_gpt(layers=3)
    members = list(model.blocks)
    assert find_blocks(model, model.blocks) == members
    assert find_blocks(model, lambda m: isinstance(m, nn.ModuleList)) == members
    assert find_blocks(None, [nn.ModuleDict({"a": model.blocks[0], "b": model.blocks[2]})]) \
        == [model.blocks[0], model.blocks[2]]
    # A container's parameters beside its layers never run: they are not blocks, nor an error.
    beside = nn.ModuleDict({"layers": model.blocks,
                            "pos": nn.ParameterList([nn.Parameter(torch.zeros(2))])})
    assert find_blocks(None, beside) == members

    def saved_bytes(**settings):
        with offload.activations(model=model, tiers="host", **settings) as ctx:
            loss_fn().backward()
        return ctx.stats.saved_bytes

    checkpointed = saved_bytes(policy="recompute", blocks=members)
    assert saved_bytes(policy="recompute", blocks=model.blocks) == checkpointed
    assert saved_bytes(policy="keep") > 2 * checkpointed   # nothing checkpointed: all saved


@pytest.mark.parametrize("blocks, message", [
    (42, r"blocks=42\): expected a list of nn.Module blocks or a predicate"),
    ([nn.Linear(2, 2), "x"], "expected a list of nn.Module blocks"),
    # Was: dropped, so nothing was checkpointed and no error said so.
    ([nn.ParameterList([nn.Parameter(torch.ones(2))])],
     r"a ParameterList has no forward of its own and holds no module that runs"),
    (nn.ModuleDict({"p": nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})}),
     r"a ModuleDict has no forward of its own and holds no module that runs"),
])
def test_blocks_argument_errors(blocks, message):
    with pytest.raises(ConfigError, match=message):
        offload.activations(policy="recompute", blocks=blocks)


def test_predicate_needs_a_model():
    with pytest.raises(ConfigError, match=r"a predicate needs model="):
        offload.activations(policy="auto", blocks=lambda m: True)


# ---------------------------------------------------------------- wrapping
def test_wrappers_restore_forward_exactly():
    model, _ = small_gpt(layers=2)
    own = lambda x: x  # noqa: E731  a forward the user set on the instance
    model.blocks[1].forward = own
    with BlockWrappers(model.blocks, lambda i, f, a, k: f(*a, **k)):
        assert "forward" in model.blocks[0].__dict__
    assert "forward" not in model.blocks[0].__dict__
    assert model.blocks[1].forward is own


def test_context_exit_restores_blocks_also_after_an_exception():
    model, loss_fn = small_gpt(layers=2)
    with pytest.raises(ValueError, match="boom"):
        with offload.activations(model=model, policy="recompute"):
            loss_fn()
            assert "forward" in model.blocks[0].__dict__
            raise ValueError("boom")
    assert all("forward" not in b.__dict__ for b in model.blocks)


# ---------------------------------------------------------------- recompute policy
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_recompute_is_bit_exact_for_20_steps(tiers, nvme_dir):
    model, loss_fn = small_gpt(layers=3)
    kw = {"nvme_dir": nvme_dir} if tiers == "nvme" else {}
    differs, ctx = compare_steps(model, loss_fn, 20, policy="recompute", tiers=tiers,
                                 min_bytes=0, **kw)
    assert differs is None, f"gradients differ at step {differs}"
    if tiers == "nvme":
        assert ctx.stats.nvme_bytes > 0  # block inputs went through the tier
    ctx.close()


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_recompute_hugging_face_models_bit_exact_20_steps(build):
    model, loss_fn = build()
    differs, _ = compare_steps(model, loss_fn, 20, policy="recompute", min_bytes=0)
    assert differs is None, f"gradients differ at step {differs}"


def test_recompute_saves_only_block_inputs_and_outside_tensors():
    model, loss_fn = small_gpt(layers=4, hidden=64, seq=64)
    with offload.activations(model=model, policy="keep", min_bytes=0) as keep:
        loss_fn().backward()
    with offload.activations(model=model, policy="recompute", min_bytes=0) as rec:
        loss_fn().backward()
    # Inside blocks checkpoint's own hooks hold the saves; ours see inputs and the head.
    assert rec.stats.saved_bytes < 0.4 * keep.stats.saved_bytes


def test_checkpoint_kwargs_tensors_reach_our_hooks():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, *, scale):
            return self.lin(x).sin() * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x, scale):
            for layer in self.layers:
                x = layer(x, scale=scale)
            return x

    net = Net()
    x, scale = torch.randn(8, 16), torch.randn(8, 16)  # (a leaf needing grad counts as a
    with offload.activations(model=net, policy="recompute", min_bytes=0) as ctx:  # parameter)
        net(x, scale).sum().backward()
    # Checkpoint inputs: x, layer 0's output, and `scale` (passed by keyword, stored once):
    # held in checkpoint's closure it would be out of our reach.
    assert ctx.stats.saved_bytes == 3 * x.nbytes


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x).tanh()


class _UserCheckpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.layers = nn.ModuleList(_Counting() for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_users_checkpointed_block_is_not_wrapped_twice(policy, reentrant, monkeypatch):
    net = _UserCheckpointed(reentrant)
    x = torch.randn(4, 32, requires_grad=True)
    ours = []
    for mod in (recompute_session, auto_session, recompute_mod):
        original = mod.checkpoint_block

        def counting(*a, _original=original, **k):
            ours.append(1)
            return _original(*a, **k)
        monkeypatch.setattr(mod, "checkpoint_block", counting)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    for step in range(3):  # auto: warm-up, profile, planned
        net.zero_grad()
        for layer in net.layers:
            layer.calls = 0
        with offload.activations(model=net, policy=policy, min_bytes=0,
                                 probe="nvme_write_gbps=1e-3,nvme_read_gbps=1e-3"):
            net(x).sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters()))
        # The user's checkpoint: one forward, one recompute. Ours on top would add more.
        assert [layer.calls for layer in net.layers] == [2, 2, 2]
    assert ours == []


def test_no_offload_region_runs_blocks_as_they_are():
    model, loss_fn = small_gpt(layers=2)
    with offload.activations(model=model, policy="recompute", min_bytes=0) as rec:
        with offload.no_offload():
            loss_fn().backward()
    with offload.activations(model=model, policy="keep", min_bytes=0) as keep:
        with offload.no_offload():
            loss_fn().backward()
    assert rec.stats.saved_bytes == keep.stats.saved_bytes  # nothing was checkpointed


class KVCache:
    """A key/value cache as Hugging Face's `Cache`: a forward appends to it."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> None:
        self.keys.append(key)


class CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, cache=None):
        if cache is not None:
            cache.update(x)
        return x + torch.tanh(self.lin(x))


class CachingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachingBlock() for _ in range(3))

    def forward(self, x, cache=None):
        for block in self.blocks:
            x = block(x, cache=cache)
        return x


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_block_given_a_cache_runs_as_is_said_once_per_model(policy, nvme_dir, tmp_path,
                                                              monkeypatch, caplog):
    """session_base.holds_cache: a block handed a key/value cache runs as is (its re-run
    would append to the cache again), said once for the model. Before, once per context,
    so once per step with the README's context per step."""
    import logging

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    offload.process.reset()
    torch.manual_seed(0)
    model = CachingStack()
    cache = KVCache()
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(4):
            with offload.activations(model=model, policy=policy, tiers="nvme",
                                     nvme_dir=nvme_dir, min_bytes=0):
                model(torch.randn(4, 16), cache=cache).sum().backward()
    assert len(cache.keys) == 3 * 4   # each block appended once per step: not re-run
    said = [r for r in caplog.records if "key/value" in r.getMessage() or
            "KVCache" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def _grads_of(model, loss_fn, ctx=None) -> list:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)   # the same dropout masks
    if ctx is None:
        loss_fn().backward()
    else:
        with ctx:
            loss_fn().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("given", [False, True])
def test_blocks_added_or_removed_after_the_context_was_built_are_found(policy, given,
                                                                       nvme_dir):
    """A context finds its blocks when it is built; a block appended to `model.blocks`
    later ran as it is, never checkpointed (a helper's report: saved bytes went from 250 KB
    to 1.23 MB a step, and `auto` kept over its budget from then on, saying nothing). The
    blocks are found again at the next entry after their container changed (stack_watch.py
    StackWatch): a step keeps what a context built now keeps, bit-exact. So are blocks in
    a new container put in the old one's place (`model.blocks = nn.ModuleList(...)`:
    before, they ran as they are, and `recompute` said no block ran)."""
    from offload.bench.models import Block

    model, loss_fn = small_gpt(layers=2, hidden=64, seq=64)
    settings = dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    if policy == "auto":
        settings.update(probe="compute_gflops=100,dispatch_op_s=1e-6,nvme_write_gbps=1e-4,"
                              "nvme_read_gbps=1e-4,nvme_issue_s=1e-6", budget="30%")
    if given:
        settings["blocks"] = model.blocks
    ctx = offload.activations(model=model, **settings)
    changes = ("append", "replace", "remove") + (() if given else ("a new container",))
    for change in changes:
        for _ in range(3):   # auto: warm-up, profile, planned
            _grads_of(model, loss_fn, ctx)
        torch.manual_seed(3)
        if change == "append":
            model.blocks.append(Block(model.cfg))
        elif change == "replace":   # the same count: told by identity, not length
            model.blocks[1] = Block(model.cfg)
        elif change == "remove":
            del model.blocks[0]
        else:   # (blocks= names the old container: that one is what it asks for)
            model.blocks = nn.ModuleList([model.blocks[0], Block(model.cfg)])
        fresh = offload.activations(model=model, **settings)
        for _ in range(3):
            plain = _grads_of(model, loss_fn)
            ours = _grads_of(model, loss_fn, ctx)
            theirs = _grads_of(model, loss_fn, fresh)
            assert all(torch.equal(a, b) for a, b in zip(plain, ours))
            assert all(torch.equal(a, b) for a, b in zip(plain, theirs))
            assert ctx.stats.saved_bytes == fresh.stats.saved_bytes
            assert ctx.stats.peak_resident_bytes == fresh.stats.peak_resident_bytes
        if policy == "auto":
            assert sorted(ctx.plan.block_type) == list(range(len(model.blocks)))
        fresh.close()
    ctx.close()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_blocks_found_before_stay_when_none_is_found_now(policy, nvme_dir, caplog):
    """A module of another class appended to the detected stack (a final LayerNorm on a
    Sequential of blocks) makes it no stack of one class: `recompute` raised "found no
    blocks" at the next entry and `auto` ran with none (a review of the change above). The
    blocks found before stay, said once; and `ctx.plan` read inside the block never
    changes the blocks of the step running (its wrappers stayed on the blocks for good)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 32)
    settings = dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    ctx = offload.activations(model=model, **settings)
    with ctx:
        model(x).sum().backward()
    model.append(nn.LayerNorm(32))
    with ctx:
        _ = ctx.plan   # while active: no new session
        assert all("forward" in vars(block) for block in model[:4])   # wrapped
        model(x).sum().backward()
    assert not any("forward" in vars(block) for block in model)   # unwrapped, all of them
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(3):
            with ctx:
                assert all("forward" in vars(block) for block in model[:4])
                model(x).sum().backward()
    assert caplog.text.count("none is found now; the 4 found before run as before") == 1
    ctx.close()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_block_replaced_by_another_class_is_not_said_to_run_as_before(policy, nvme_dir,
                                                                         caplog):
    """A block replaced by a module of another class (no stack of one class is found now):
    the warning counts only the blocks found before that the model still holds (it said
    all of them "run as before"); the replacement runs as it is, gradients exact."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    plain = copy.deepcopy(model)
    x = torch.randn(8, 32)
    ctx = offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                              min_bytes=0)
    with ctx:
        model(x).sum().backward()
    plain(x).sum().backward()
    torch.manual_seed(1)
    model[1] = nn.Linear(32, 32)
    torch.manual_seed(1)
    plain[1] = nn.Linear(32, 32)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            with ctx:
                model(x).sum().backward()
            plain(x).sum().backward()
    assert caplog.text.count("none is found now; the 3 of the 4 found before that the model "
                             "still holds run as before (1 replaced or removed") == 1, caplog.text
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    ctx.close()



class _ChecksItselfReentrant(nn.Module):
    """A block whose forward checkpoints its body with a reentrant checkpoint (Hugging
    Face's gradient checkpointing with use_reentrant=True does this), returning what the
    checkpoint returns, or adding the residual after it."""

    calls = 0
    checkpointing = True   # (off: gradient_checkpointing_enable() not called yet)

    def __init__(self, residual_outside: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.residual_outside = residual_outside

    def body(self, x):
        _ChecksItselfReentrant.calls += 1
        y = self.fc2(torch.relu(self.fc1(x)))
        return y if self.residual_outside else x + y

    def forward(self, x):
        if not _ChecksItselfReentrant.checkpointing:
            y = self.body(x)
        else:
            y = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True)
        return x + y if self.residual_outside else y


class _Plain(_ChecksItselfReentrant):
    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("switched_on_later", [False, True])
@pytest.mark.parametrize("residual_outside", [False, True])
def test_a_block_that_runs_a_reentrant_checkpoint_itself_is_not_wrapped_again(
        nvme_dir, residual_outside, switched_on_later, monkeypatch):
    """A helper's find: our wrapper comes before the block's own reentrant checkpoint, so
    `recompute` checkpointed it again and its body ran three times a step (Hugging Face
    Trainer with gradient_checkpointing and use_reentrant=True: 90 block calls where 60
    ran without offload). Seen at the first call now, among the nodes the call made (not
    only its output's: a review's residual added after the checkpoint); from then on it
    runs as written, twice a step, bit-exact. Also when its checkpoint is switched on
    after a first step (a review's find: the one look was spent on that step)."""
    monkeypatch.setattr(_ChecksItselfReentrant, "checkpointing", not switched_on_later)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *[_ChecksItselfReentrant(residual_outside)
                                                for _ in range(4)], _Plain(residual_outside))
    plain = copy.deepcopy(model)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0,
                              blocks=lambda m: isinstance(m, _ChecksItselfReentrant))
    counts = []
    for step in range(5 if switched_on_later else 4):
        if step == 1:
            _ChecksItselfReentrant.checkpointing = True
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            _ChecksItselfReentrant.calls = 0
            with ctx if m is model else contextlib.nullcontext():
                m(x).square().sum().backward()
            if m is model:
                counts.append(_ChecksItselfReentrant.calls)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                                 model.parameters())), step
    # 4 blocks, forward and the checkpoint's re-run; the plain block after them is still
    # checkpointed (forward and our re-run): the nodes they made are not its own
    assert counts[-3:] == [10, 10, 10], counts
    assert ctx._schedule._own_checkpoint == {0, 1, 2, 3}
    ctx.close()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()

    def forward(self, x):
        return self.encoder(x).square().sum()


@pytest.mark.parametrize("replaced", ["the container", "a module above it"])
def test_blocks_under_a_replaced_module_are_found_again(nvme_dir, replaced):
    """A review's find: the watch looked at each detected container's slot in its parent
    only, so `model.encoder = Encoder()` (a module above `encoder.layers`) left the old
    blocks wrapped and the new ones ran as they are, no block checkpointed. Each container
    is watched down its path from the model now."""
    torch.manual_seed(0)
    model = _WithEncoder()
    ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with ctx:
        model(x).backward()
    if replaced == "the container":
        model.encoder.layers = _Encoder().layers
    else:
        model.encoder = _Encoder()
    plain = copy.deepcopy(model)
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        with ctx if m is model else contextlib.nullcontext():
            m(x).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                             model.parameters()))
    assert ctx._schedule.blocks == list(model.encoder.layers)
    assert ctx._schedule._ran == 3   # every new block checkpointed
    ctx.close()
