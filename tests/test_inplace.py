"""In-place changes to saved tensors raise autograd's own error on every tier (NOTE [Version
check] in offload/runtime/version_check.py), word for word, whatever the saved tensor's lifetime.

Each case is a forward that changes a saved tensor in place the way user code does; plain
autograd raises for all of them. The reference message comes from plain autograd on the
same code, so the op named ("output 0 of Tanh") is checked too. The dangerous lifetime is
"saved, changed, dropped": the moved tensor is gone when backward runs, and without a check
the gradient would be computed from whatever bytes the transfer had copied.
"""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import offload

TIERS = ["host", "nvme", "host,nvme"]


def _kw(tiers, nvme_dir):
    kw = {"tiers": tiers, "min_bytes": 0}
    if "nvme" in tiers:
        kw["nvme_dir"] = nvme_dir
    return kw


def _relu_inplace_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.ReLU(inplace=True),
                         nn.Linear(512, 8))


def relu_inplace(x):
    """The issue's reproducer: tanh saves its output, ReLU(inplace) changes it, it dies."""
    return _relu_inplace_model()(x).sum()


def detach_alias(x):
    h = torch.tanh(x @ torch.ones(256, 256))  # saves its output h
    d = h.detach()
    y = (h * 3).sum()
    d.mul_(2)                                   # through an alias autograd tracks
    del h, d
    return y


def base_of_saved_view(x):
    b = x * 2
    v = b[:, :128]
    y = v.sin().sum()                           # saves v, a view of b
    b.add_(1)                                   # changes the base
    del b, v
    return y


def sibling_view(x):
    b = x * 2
    left, right = b.chunk(2, dim=1)
    y = left.sin().sum()                        # saves `left`
    right.mul_(3)                               # a sibling shares the version counter
    del b, left, right
    return y


def input_still_alive(x):
    h = x * 2
    y = h.sin().sum()                           # saves its input h
    h.add_(1)                                   # autograd names the in-place op (Add)
    input_still_alive.keep = h
    return y


def input_changed_then_dropped(x):
    h = x * 2
    y = h.sin().sum()                           # saves its input h
    h.add_(1)
    del h                                       # autograd would name Add; we name Mul
    return y


def changed_twice_then_saved_again(x):
    h = torch.exp(x)                            # saves its output at version 0
    h.mul_(2)
    z = (h.cos()).sum()                         # saves h at version 1 (another record)
    h.add_(1)                                   # both saves are stale now
    del h
    return z


CASES = [relu_inplace, detach_alias, base_of_saved_view, sibling_view, input_still_alive,
         input_changed_then_dropped, changed_twice_then_saved_again]
# Autograd keeps a saved input alive and names its last in-place op. A tensor that stays
# (the host tier on a CPU run) is held the same way: the same op. A moved one is not held;
# once the tensor died, the op named is its producer (version_check.py module doc). The
# rest of the message holds.
PRODUCER_NAMED = {"input_changed_then_dropped": ("of Add,", "of Mul,"),
                  "changed_twice_then_saved_again": ("of Add,", "of Mul,")}


def _producer_named(case, message, moved=True):
    return message.replace(*PRODUCER_NAMED[case.__name__]) \
        if moved and case.__name__ in PRODUCER_NAMED else message


def _plain_error(case, x):
    with pytest.raises(RuntimeError) as plain:
        case(x.clone().requires_grad_()).backward()
    return str(plain.value)


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_inplace_change_raises_autograds_error(case, tiers, nvme_dir):
    x = torch.randn(64, 256)
    expected = _plain_error(case, x)
    # host and host,nvme hold everything by reference on a CPU run (the host tier fits it).
    expected = _producer_named(case, expected, moved=tiers == "nvme")
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        with pytest.raises(RuntimeError) as ours:
            case(x.clone().requires_grad_()).backward()
    assert str(ours.value) == expected
    moved = ctx.stats.host_bytes + ctx.stats.nvme_bytes
    assert moved > 0, "the case must move what it saves, or it tests nothing"
    if tiers == "nvme":
        assert ctx.stats.nvme_bytes > 0


@pytest.mark.parametrize("tiers", ["nvme"])
def test_change_after_the_write_landed_still_raises(tiers, nvme_dir):
    """The write is complete before the change: the bytes on disk are right, but plain
    autograd raises, so we must too (the sentinel outlives the write and the tensor)."""
    x = torch.randn(64, 256, requires_grad=True)
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        h = torch.tanh(x * 2)
        y = h.sum() * 1
        ctx.tiers["nvme"].drain()             # every write has landed
        h.add_(1)
        del h
        with pytest.raises(RuntimeError, match="output 0 of Tanh, is at version 1"):
            y.backward()
    assert ctx.stats.nvme_written_bytes > 0


def test_change_between_two_backwards_with_retain_graph(nvme_dir):
    x = torch.randn(64, 256, requires_grad=True)
    with offload.activations(**_kw("nvme", nvme_dir)):
        h = torch.exp(x)
        y = (h * h).sum()
        y.backward(retain_graph=True)
        h.zero_()
        del h
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("tiers", TIERS)
def test_no_change_gives_bit_exact_gradients(tiers, nvme_dir):
    """The control: the same model without the in-place op trains exactly as plain autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.ReLU(), nn.Linear(512, 8))
    x = torch.randn(64, 256)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        model(x).sum().backward()
    assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))


def test_sentinel_holds_no_storage():
    """The version sentinel follows the counter but does not keep the activation alive."""
    from offload.runtime.version_check import version_sentinel

    t = torch.randn(1 << 20) * 2
    ref = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())  # to watch the bytes
    sentinel = version_sentinel(t)
    assert sentinel.untyped_storage().nbytes() == 0
    view = t[:10]
    del t
    gc.collect()
    view.add_(1)
    assert sentinel._version == 1
    del ref


def test_data_change_is_invisible_as_in_autograd():
    """`.data` bypasses the version counter, for autograd and for us alike (README)."""
    from offload.runtime.version_check import version_sentinel

    t = torch.randn(10) * 2
    sentinel = version_sentinel(t)
    t.data.mul_(2)
    assert sentinel._version == 0 and t._version == 0


@pytest.mark.cuda
@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_inplace_change_raises_on_cuda(case, tiers, nvme_dir):
    """Same on a GPU: the D2H runs on the side stream while the forward changes the tensor."""
    x = torch.randn(64, 256, device="cuda")
    with torch.device("cuda"):
        expected = _producer_named(case, _plain_error(case, x))
        with offload.activations(**_kw(tiers, nvme_dir)):
            with pytest.raises(RuntimeError) as ours:
                case(x.clone().requires_grad_()).backward()
    assert str(ours.value) == expected


def _resized_after_the_forward(x, w, new_nbytes):
    """A saved input whose memory the user's code frees (`resize_(0)`, as FSDP and ZeRO do
    with their buffers) or grows (its bytes move to new memory) after the forward."""
    kept = x.clone()
    y = (kept @ w).tanh()
    kept.untyped_storage().resize_(new_nbytes(kept))
    y.sum().backward()
    return kept


@pytest.mark.parametrize("tiers", TIERS)
def test_a_saved_storage_freed_after_the_forward_raises_as_in_autograd(tiers, path, nvme_dir):
    """saved_handles.py NOTE [A storage resized since its pack]: plain autograd raises torch's
    bounds error in backward; a moved save came back from its tier's copy instead, read
    from memory freed while its write was in flight (wrong gradients, silently). The
    storage is not grown back by the unpack either."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        _resized_after_the_forward(x, w, lambda t: 0)
    for attempt in range(3):   # the write in flight or landed when the memory is freed
        with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
            with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
                _resized_after_the_forward(x, w, lambda t: 0)
        assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0
        assert w.grad is None


@pytest.mark.parametrize("tiers", TIERS)
def test_a_saved_storage_grown_after_the_forward_gives_autograds_gradient(tiers, path,
                                                                         nvme_dir):
    """Grown, the storage's bytes move to new memory: autograd computes from them, and so
    does a moved save (its tier's copy may have been read from the freed old memory)."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256)
    grown = lambda t: 2 * t.untyped_storage().nbytes()   # noqa: E731
    _as_in_autograd(lambda: _resized_after_the_forward(x, w, grown), w, _kw(tiers, nvme_dir), 3)


def _as_in_autograd(step, w, kw, attempts):
    """`step()` gives `w` the same gradient under offload (`kw`), every attempt (the write
    in flight or landed), as without it."""
    step()
    want, w.grad = w.grad, None
    for attempt in range(attempts):
        with offload.activations(**kw) as ctx:
            step()
        assert torch.equal(w.grad, want)
        assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0
        w.grad = None


def _moved_after_the_forward(x, w, move):
    """A saved input whose bytes the user's code moves to new memory after the forward,
    values kept: `share_memory_()` (a torch.multiprocessing queue's `put` calls it), or a
    storage resized there and back."""
    kept = x.clone()
    y = (kept @ w).tanh()
    move(kept)
    assert torch.equal(kept, x)
    y.sum().backward()


def _there_and_back(t):
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(2 * nbytes)
    storage.resize_(nbytes)


@pytest.mark.parametrize("move", [torch.Tensor.share_memory_, _there_and_back],
                         ids=["share_memory", "resized-there-and-back"])
@pytest.mark.parametrize("tiers", TIERS)
def test_a_saved_storage_moved_after_the_forward_gives_autograds_gradient(move, tiers, path,
                                                                          nvme_dir):
    """csrc/nvme_transfers.hpp NOTE [A source that moved]: a small save's nvme write waits
    in its batch; the move frees the memory it was to be written from (wrong gradients,
    silently, in nearly every run). Autograd reads the bytes where they are now."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    _as_in_autograd(lambda: _moved_after_the_forward(x, w, move), w, _kw(tiers, nvme_dir), 5)


def test_a_storage_moved_while_the_disk_writes_it_gives_autograds_gradient(path, nvme_dir):
    """NOTE [A source that moved], the retire side: a 64 MiB save goes to the engine at
    once, throttled so that its write is still running when the storage moves
    (`share_memory_()` unmaps the old memory under it): the write failed with EFAULT (a
    StorageError in backward) or held bytes read from freed memory. Retiring it now writes
    the bytes from where the storage keeps them."""
    torch.manual_seed(0)
    w = torch.randn(4096, 8, requires_grad=True)
    x = torch.randn(4096, 4096)   # 64 MiB: written chunk by chunk, most after the move

    _as_in_autograd(lambda: _moved_after_the_forward(x, w, torch.Tensor.share_memory_), w,
                    dict(_kw("nvme", nvme_dir), nvme_max_bw="200MB"), 1)


_MOVED_WHILE_QUEUED = r"""
import sys, torch, offload
mode, nvme_dir, checksum = sys.argv[1], sys.argv[2], sys.argv[3] == "checksum"
torch.manual_seed(0)
w = torch.randn(5120, 8, requires_grad=True)
# 40 MiB each: over glibc's 32 MiB threshold the victim has a mapping of its own, which a
# move unmaps at once; the filler's write queues ahead of it.
filler, victim = torch.randn(2048, 5120), torch.randn(2048, 5120)


def step(move):
    w.grad = None
    a, v = filler.clone(), victim.clone()
    y = (a @ w).tanh().sum() + (v @ w).tanh().sum()   # saves a and v: written at the pack
    move(v)
    try:
        y.backward()
    except RuntimeError as exc:   # a freed save: torch's error (which may name another view)
        return str(exc).split(":")[0]
    return w.grad


moves = {"share": torch.Tensor.share_memory_,
         "free": lambda v: v.untyped_storage().resize_(0)}
plain = step(moves[mode])
with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, nvme_max_bw="50MB",
                         nvme_checksum=checksum):
    ours = step(moves[mode])
same = torch.equal(plain, ours) if isinstance(plain, torch.Tensor) else plain == ours
print("AS IN AUTOGRAD", same, plain if isinstance(plain, str) else "")
"""


@pytest.mark.parametrize("mode,checksum", [("share", "no-checksum"), ("free", "no-checksum"),
                                           ("share", "checksum"), ("free", "checksum")])
def test_a_storage_moved_or_freed_while_its_write_waits_in_the_engine(mode, checksum,
                                                                       nvme_dir):
    """NOTE [A source that moved], in the engine: a write queued behind another (a slow
    disk) whose storage is moved (`share_memory_()`) or freed (`resize_(0)`, as FSDP and
    ZeRO do) before a worker reaches it. The worker copied its partial sectors from the
    unmapped memory with memcpy: SIGSEGV, the process gone (found by an ASan run). It now
    copies them through the kernel, which says EFAULT, and the retire writes the bytes again
    from where they are. With `OFFLOAD_NVME_CHECKSUM=1` the CRC of a direct write read the
    tensor's memory itself, and faulted the same way: it now reads it as the copies do. In a
    child process: the old code kills it."""
    proc = subprocess.run([sys.executable, "-c", _MOVED_WHILE_QUEUED, mode, nvme_dir, checksum],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "AS IN AUTOGRAD True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


class _DoublesItsSave(torch.autograd.Function):
    """A backward that writes into the tensor it unpacked (to save memory, say)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        x.mul_(2)
        return grad * x


def _write_by_a_backward(x0):
    x = x0.clone().requires_grad_()
    h = x.sin()
    p = h.pow(3)                 # PowBackward saves h and runs after the Function's backward
    (p.sum() + _DoublesItsSave.apply(h).sum()).backward()


def _write_through_saved_self(x0):
    x = x0.clone().requires_grad_()
    a = x.tanh()
    b = a * x                    # MulBackward saves a (`_saved_self`) ...
    y = a.exp() * b              # ... and so does ExpBackward (its result, another tensor)
    with torch.no_grad():
        b.grad_fn._saved_self.mul_(2)
    y.sum().backward()


@pytest.mark.parametrize("write", [_write_by_a_backward, _write_through_saved_self],
                         ids=["backward-writes-its-save", "saved_self-written"])
@pytest.mark.parametrize("tiers", TIERS)
def test_a_write_into_an_unpacked_copy_raises_for_the_next_save_as_in_autograd(write, tiers,
                                                                                nvme_dir):
    """records.py NOTE [Writes into a shared copy]: every save of a storage is handed the
    same loaded copy on nvme; a write into it reached the saves unpacked after it, which
    computed with the changed values where autograd raises its in-place error."""
    torch.manual_seed(0)
    x0 = torch.randn(4096)
    with pytest.raises(RuntimeError) as plain:
        write(x0)
    for attempt in range(2):
        with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
            with pytest.raises(RuntimeError) as ours:
                write(x0)
        assert str(ours.value) == str(plain.value)
        assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0


class _DoublesItsSavedFactor(torch.autograd.Function):
    """y * t, saving t; its backward writes into the t it unpacked."""

    @staticmethod
    def forward(ctx, y, t):
        ctx.save_for_backward(t)
        return y * t

    @staticmethod
    def backward(ctx, grad):
        t, = ctx.saved_tensors
        out = grad * t
        t.mul_(2)
        return out, None


def _write_into_a_save_with_gaps(x0):
    t = x0.view(64, 64)[:, :16].detach()   # an untracked alias with gaps between its elements
    y = torch.ones(64, 16, requires_grad=True)
    _DoublesItsSavedFactor.apply(y * t, t).sum().backward()   # MulBackward saves t too


def test_a_write_into_a_save_handed_back_with_its_strides_raises_as_in_autograd(nvme_dir):
    """tensor_meta NOTE [Snapshot strides]: a save with gaps is handed a fresh tensor with its
    strides, not a view of the loaded bytes, so a write into it did not move their counter:
    the next save of it got the written tensor, silently, where autograd raises (a review's
    find). The unpack cache counts the writes into such a tensor itself."""
    x0 = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError) as plain:
        _write_into_a_save_with_gaps(x0.clone())   # (it writes into x0's bytes)
    with offload.activations(**_kw("nvme", nvme_dir)) as ctx:
        with pytest.raises(RuntimeError) as ours:
            _write_into_a_save_with_gaps(x0.clone())
    assert str(ours.value) == str(plain.value)
    assert ctx.stats.nvme_bytes > 0


def _saved_copy_slices_output_changed_through_a_view():
    x = torch.randn(64, 64, requires_grad=True)
    y = x * 1
    y[:1].mul_(2)                 # y's grad_fn: CopySlices
    s = y.sin()                   # saves y
    y[1:][:, 2:].zero_()          # changed through a view of a view: CopySlices again
    s.sum().backward()


def _saved_copy_output_changed():
    x = torch.randn(64, 64, requires_grad=True)
    y = torch.zeros(64, 64)
    y.copy_(x)                    # y's grad_fn: CopyBackwards
    s = y * y                     # saves y (as an input: named at unpack)
    y[:, :1].mul_(2)
    s.sum().backward()


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("case", [_saved_copy_slices_output_changed_through_a_view,
                                  _saved_copy_output_changed],
                         ids=["view-of-a-view", "copy_-then-a-view"])
def test_the_error_names_autograds_own_nodes_as_autograd_does(case, tiers, nvme_dir):
    """Autograd names its own C++ nodes with their namespace ("output 0 of
    torch::autograd::CopySlices"); ours said "of CopySlices"."""
    with pytest.raises(RuntimeError) as plain:
        case()
    with offload.activations(**_kw(tiers, nvme_dir)):
        with pytest.raises(RuntimeError) as ours:
            case()
    assert "torch::autograd::CopySlices" in str(plain.value)
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.complex64, torch.int64,
                                   torch.float16], ids=str)
def test_the_error_names_each_dtype_as_autograd_does(dtype, tiers, nvme_dir):
    """Autograd names a tensor's type `torch.FloatTensor` where torch has a legacy name and
    `CPUBoolType` / `CPUBFloat16Type` / `CPUComplexFloatType` where it has none; a saved mask
    or a bfloat16 activation changed in place must read the same."""
    def case():
        w = torch.randn(64, 64, dtype=torch.complex64 if dtype.is_complex else torch.float32,
                        requires_grad=True)
        m = (torch.rand(64, 64) * 5).to(dtype)
        y = torch.where(m, w, w * 2) if dtype == torch.bool else (w * 1) * m   # saves m
        m.logical_not_() if dtype == torch.bool else m.add_(1)
        y.abs().sum().backward()

    with pytest.raises(RuntimeError) as plain:
        case()
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        with pytest.raises(RuntimeError) as ours:
            case()
    assert str(ours.value) == str(plain.value)
    assert ctx.stats.saved_bytes > 0


class _SavesIt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, saved):
        ctx.save_for_backward(saved)
        return w * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        return grad, None


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("layout", ["coo", "csr", "bsr"])
def test_the_error_names_a_sparse_tensor_as_autograd_does(layout, tiers, nvme_dir):
    """A sparse saved tensor stays where it is, and autograd's message names its type
    `torch.sparse.FloatTensor` / `SparseCsrtorch.FloatTensor` (every compressed layout);
    ours said `torch.FloatTensor` (the name was looked up by dtype and device only), then
    raised torch.empty's error for CSR, which no 1-d empty tensor has, and said
    `torch.float32` for BSR, which no empty tensor has (found by reviews)."""
    def case():
        w = torch.randn(4, requires_grad=True)
        sparse = {"coo": torch.eye(4).to_sparse, "csr": torch.eye(4).to_sparse_csr,
                  "bsr": lambda: torch.eye(4).to_sparse_bsr((2, 2))}[layout]()
        y = _SavesIt.apply(w, sparse)
        torch.autograd.graph.increment_version(sparse)
        y.sum().backward()

    with pytest.raises(RuntimeError) as plain:
        case()
    with offload.activations(**_kw(tiers, nvme_dir)):
        with pytest.raises(RuntimeError) as ours:
            case()
    assert ("torch.sparse.FloatTensor [4, 4]" if layout == "coo"
            else "SparseCsrtorch.FloatTensor [4, 4]") in str(plain.value), str(plain.value)
    assert str(ours.value) == str(plain.value)
