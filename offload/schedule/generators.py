"""The user's own random generators a block draws from, kept exact across its re-runs.

NOTE [Generators in a re-run] `recompute` and `auto` re-run blocks in backward
(checkpoint's recompute). checkpoint sets the default CPU and CUDA generators back to their
state at the block's start first, so random ops draw the same numbers again; a
`torch.Generator` of the user's (`torch.randn(..., generator=self.g)` in a noise layer or
an augmentation) it does not know. The re-run would draw other numbers, so the backward
would differentiate another function than the forward ran (silently wrong gradients), and
the generator would end the step advanced twice. Rules:

1. Which generators: every one the block's forward hands to a torch function, wherever
   the block holds it (an attribute, an argument, a module global, one made for this step),
   seen through a torch function mode around every forward call. Not once per block: a
   generator first drawn from in a later call (a new one each step, noise switched on
   after warm-up) is as wrong in its re-run as one drawn from at the first. The default
   generators are checkpoint's (it sets them back, implicit draws included).
2. The forward notes each one's state right before the call's first draw from it.
3. A re-run sets each back to that state, and afterwards to the state it had before the
   re-run: the re-run draws what the forward drew, and the generator ends the step where
   plain training leaves it. They are set back in the reverse order of their first draws,
   so two Python objects of one generator (the earlier noted state is the right one) end
   on the earlier state. (A stored random op is replayed, not re-run: stored_ops.py Rule 2
   sets its generator to its state after the op.)

4. The default generators are process-wide: another thread drawing from one while the
   block's forward or its re-run runs (an augmentation thread's `torch.rand`, a second
   model trained in the process) shifts what the re-run draws, and its gradient would
   silently differ from plain autograd's, as under checkpoint. So the forward also notes
   the default generator's state before and after each call of a function that draws from
   it implicitly (`_DRAWS_IMPLICITLY`: dropout and its kin, `rand*`, in-place samplers,
   attention with dropout; not one whose arguments say it draws nothing: p == 0, not
   training), and a re-run of a block that made any checks each such call against them,
   also when checkpoint stops the re-run inside it: a difference raises `OffloadError` in
   backward (`_DrawsAsBefore`). Not seen: a random op outside the list, or reached inside a
   function the mode sees as one call (its draws count in the next listed call's check, if
   any).

NOTE [Modes and Ctrl-C] torch calls a function mode's handler from a Python function
(`F.dropout`) inside `_pop_mode_temporarily`, a generator context manager that pops the mode
and pushes it back. A KeyboardInterrupt that lands as that context exits leaves the mode
popped, and the abandoned generator pushes it back whenever it is collected, later, on top
of whatever stack there is then. `with mode:` then popped someone else's mode, or raised
"trying to pop from empty mode stack" in place of the user's KeyboardInterrupt, and ours came
back for good: every torch call went through it, and a re-run check raised in code outside
any block. So our modes are taken off by identity wherever they are (`_under`); one that
was not there passes every call through from then on and is taken off once it is back (the
next context entry or block call on this thread sweeps: `_lost`). Not covered: a mode the
collector puts back on another thread's stack (it passes calls through there), or one a
user's own `with mode:` exit pops in ours' place (torch pops the top, whoever's it is).

NOTE [Modes under torch.compile] Dynamo traces the torch function modes on the stack
into what it compiles, and guards on what they read. A compiled block (or a compiled
function a block calls) traced our handlers: reading a generator's state broke the graph,
and `_same` made dynamo guard on the state's 5 KiB of bytes, which change every step, so
it recompiled every step until its recompile limit. Inside compiled code the handlers pass
every call through (`torch.compiler.is_compiling()`, traced as a constant): the compiled
code is what it is without us, and its re-run under checkpoint draws what the forward
drew from the default generators, which checkpoint sets back. Dynamo also guards on the
modes' types on the stack: a block that is compiled itself (blocks.compiled_block) runs
with none of ours in either pass (recompute.checkpoint_block), else its re-run, under
another mode than its forward, ran another compiled variant, whose saves did not match
(CheckpointError). Not seen: a user's generator or a thread's draw inside compiled code
(torch's own checkpoint does not see them either).

Cost: the mode on every forward call of a re-run block, some 5 µs per torch function
call on a CPU (docs/benchmarks.md *Generators seen at every call*); one `get_state` per
generator drawn from, and two per implicit draw (CPU: 5 KiB tensors, held until the
re-run); for a block that drew implicitly, the mode on its re-run too.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import _StopRecomputationError
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import OffloadError

__all__ = ["guard_generators", "sweep_lost_modes", "handed_generator"]


def _is_default(generator: torch.Generator) -> bool:
    """Whether checkpoint sets `generator` back itself (the CPU and CUDA defaults)."""
    if generator is torch.default_generator:
        return True
    return generator.device.type == "cuda" and torch.cuda.is_initialized() and \
        any(generator is g for g in torch.cuda.default_generators)


# The dropouts: `p` second and `training` third when passed by position.
_DROPOUTS = frozenset({
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout",
    "feature_dropout_"})
# Functions (as a torch function mode sees them: their `__name__`) that draw from a
# default generator when handed none (rule 4).
_DRAWS_IMPLICITLY = _DROPOUTS | {
    "native_dropout", "rrelu", "rrelu_", "gumbel_softmax", "scaled_dot_product_attention",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "poisson", "uniform_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "random_"}


def _argument(args: tuple, kwargs: dict, names: tuple, index: int, default: Any) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[index] if len(args) > index else default


def handed_generator(args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a call was handed, by keyword or by position: an aten op whose schema
    does not make it keyword-only (poisson, binomial, _standard_gamma) gets it in `args`
    at the dispatch level, and a Python function may take it positionally too."""
    generator = kwargs.get("generator")
    if isinstance(generator, torch.Generator):
        return generator
    return next((arg for arg in args if isinstance(arg, torch.Generator)), None)


def _draws_implicitly(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call may draw from a default generator (rule 4): one of
    `_DRAWS_IMPLICITLY`, handed no generator, and not one that its arguments say draws
    nothing (a dropout with p == 0 or not training, attention with dropout_p == 0: a
    Llama-style block, or any block in eval())."""
    name = getattr(func, "__name__", None)
    if name not in _DRAWS_IMPLICITLY or handed_generator(args, kwargs) is not None:
        return False
    if name in _DROPOUTS:
        p = _argument(args, kwargs, ("p",), 1, 0.5)
        return bool(_argument(args, kwargs, ("training", "train"), 2, True)) and p != 0
    if name == "scaled_dot_product_attention":
        return _argument(args, kwargs, ("dropout_p",), 4, 0.0) != 0
    if name in ("rrelu", "rrelu_"):
        return bool(_argument(args, kwargs, ("training",), 3, False))
    return True


def _default_generator_of(args: tuple, kwargs: dict) -> torch.Generator:
    """The default generator a call draws from: its device's (a `device=`, else its first
    tensor's, else torch's default device)."""
    device = kwargs.get("device")
    if device is None:
        device = next((a.device for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor)), None)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _state(generator: torch.Generator) -> torch.Tensor:
    # Made without the dispatcher (no op of the block for stored_ops.py to count), and
    # without _disable_current_modes, which costs ~17 µs a call: 2-3 % of a small GPT's step.
    return generator.get_state()


def _same(state: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two generator states (CPU byte tensors) are equal, read without the
    dispatcher (torch.equal is an op the block's modes would see)."""
    return state.numel() == other.numel() and \
        ctypes.string_at(state.data_ptr(), state.numel()) == \
        ctypes.string_at(other.data_ptr(), other.numel())


_modes = torch._C   # torch's function-mode stack (its private calls)
# Weak references to our modes an interrupt took off torch's stack (NOTE [Modes and Ctrl-C]):
# each comes back when the interrupted call's generator is collected, and dies once off.
_lost: list[weakref.ref] = []


class _BlockMode(TorchFunctionMode):
    """A function mode around one call of a block, run by `_under`; passes every call
    through once taken off (NOTE [Modes and Ctrl-C])."""

    off = False


def _under(mode: _BlockMode, fn: Callable, args: tuple) -> Any:
    """`fn(*args)` with `mode` pushed, taken off again whatever happens."""
    if _lost:
        sweep_lost_modes()
    try:
        mode.__enter__()
        return fn(*args)
    finally:
        mode.off = True
        if not _take_off(mode):
            _lost.append(weakref.ref(mode))


def _take_off(mode: _BlockMode) -> bool:
    """Take `mode` off torch's function-mode stack wherever it is (the modes above it put
    back in their order); whether it was there."""
    above = []
    try:
        while _modes._len_torch_function_stack():
            top = _modes._pop_torch_function_stack()
            if top is mode:
                return True
            above.append(top)
        return False
    finally:
        for other in reversed(above):
            _modes._push_on_torch_function_stack(other)


def sweep_lost_modes() -> None:
    """Take off torch's stack any of our modes an interrupt left to come back (NOTE [Modes
    and Ctrl-C]); a context's entry calls it, so the step after a Ctrl-C has none."""
    if not _lost:
        return
    waiting = []
    for ref in _lost:
        mode = ref()
        if mode is not None and not _take_off(mode):
            waiting.append(ref)   # its generator is not collected yet
    _lost[:] = waiting


class _SeeGenerators(_BlockMode):
    """The forward of one call: each generator handed to a torch function, its state noted
    before the call's first draw from it (rules 1 and 2), and the default generator's
    before and after each implicit draw (rule 4)."""

    def __init__(self, states: dict, draws: list) -> None:
        super().__init__()
        self.states = states
        self.draws = draws

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or self.off:   # NOTE [Modes under torch.compile]
            return func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None:
            self._note(generator)
        for arg in args:   # torch's own functions take it by keyword; a user's may not
            if isinstance(arg, torch.Generator):
                self._note(arg)
        if not _draws_implicitly(func, args, kwargs):
            return func(*args, **kwargs)
        default = _default_generator_of(args, kwargs)
        draw = [default, _state(default), None]   # the generator, before, after
        self.draws.append(draw)
        out = func(*args, **kwargs)
        draw[2] = _state(default)
        return out

    def _note(self, generator) -> None:
        if isinstance(generator, torch.Generator) and generator not in self.states and \
                not _is_default(generator):
            with _disable_current_modes():   # (a user's generator may be any subclass)
                self.states[generator] = generator.get_state()


class _DrawsAsBefore(_BlockMode):
    """A re-run of a block whose forward drew implicitly: each such draw starts and ends
    where the forward's did (rule 4)."""

    def __init__(self, draws: list) -> None:
        super().__init__()
        self.draws = draws
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or self.off or self.seen >= len(self.draws) or \
                not _draws_implicitly(func, args, kwargs):
            return func(*args, **kwargs)
        generator, before, after = self.draws[self.seen]
        self.seen += 1
        self._check(generator, before, "before", func)
        try:
            out = func(*args, **kwargs)
        except _StopRecomputationError:   # checkpoint ends a re-run early from a save,
            self._check(generator, after, "after", func)   # after the op drew
            raise
        self._check(generator, after, "after", func)
        return out

    def _check(self, generator, state, where: str, func) -> None:
        if _same(_state(generator), state):
            return
        raise OffloadError(
            f"offload: a block's re-run in backward (policy='recompute' / 'auto') would draw "
            f"other random numbers than its forward: torch's default "
            f"{generator.device.type.upper()} generator was elsewhere {where} its "
            f"{_ordinal(self.seen)} random call ({func.__name__}), so the re-run's dropout "
            "masks would differ and the gradient with them. Either another thread drew from "
            "it while the block ran (forward or re-run): give threads that draw random "
            "numbers a torch.Generator of their own (or draw in DataLoader worker processes); "
            "or the block drew in its forward what its re-run does not (a buffer drawn at the "
            "first call) or the other way round. Else use policy='offload'.")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class _Guard:
    """One checkpointed call of a block: the forward notes, the re-runs set back (and
    check the default generators' draws: rule 4)."""

    def __init__(self) -> None:
        self.states: dict = {}   # generator -> its state before the forward's first draw
        self.draws: list = []    # [default generator, state before, after] per implicit draw
        self.calls = 0

    def wrap(self, fn: Callable) -> Callable:
        def run(*args):
            self.calls += 1
            if self.calls > 1:
                if not self.draws:
                    return self._rerun(fn, args)
                return _under(_DrawsAsBefore(self.draws), self._rerun, (fn, args))
            return _under(_SeeGenerators(self.states, self.draws), fn, args)
        return run

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        if not self.states:
            return fn(*args)
        with _disable_current_modes():
            now = {g: g.get_state() for g in self.states}
            for generator, state in reversed(self.states.items()):   # rule 3's order
                generator.set_state(state)
        try:
            return fn(*args)
        finally:
            with _disable_current_modes():
                for generator, state in now.items():
                    generator.set_state(state)


def guard_generators(fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the generators its
    forward draws from set back for its re-runs (NOTE [Generators in a re-run]); `fn`
    itself under torch.compile."""
    if torch.compiler.is_compiling():
        return fn
    return _Guard().wrap(fn)
