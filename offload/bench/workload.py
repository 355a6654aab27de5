"""The model, the fixed batch and the loss a worker trains on.

Built-in: the GPT of :mod:`offload.bench.models` (``loss = cross-entropy of next-token targets``).

``--hf TYPE`` or ``--hf config.json``: a Hugging Face causal LM (:mod:`offload.bench.hf`),
inputs ``input_ids`` and ``labels``, its own loss.

``--model module:factory`` (or ``path/to/file.py:factory``): ``factory()`` returns an
``nn.Module``; the input is ``torch.randn(batch, *input_shape)`` (token ids,
``torch.randint(input_vocab, ...)``, with ``--input-vocab``) and the loss is
``output.float().pow(2).mean()`` (for a tuple, list, dict or Hugging Face ModelOutput, of its
first element). The loss is arbitrary but fixed, which is all a memory/time/gradient
comparison needs.

The blocks the checkpointing rows wrap are the ones ``policy="recompute"`` picks
(offload/schedule/blocks.py), for every kind of model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from offload.bench.spec import RunSpec
from offload.bench.models import GPT, GPTConfig
from offload.schedule.blocks import find_blocks

__all__ = ["Workload", "build_workload", "load_factory", "load_module", "checkpointed",
           "block_names"]


@dataclasses.dataclass
class Workload:
    """A model on its device plus a loss closure over one fixed batch."""

    model: nn.Module
    blocks: list[nn.Module]           # what the checkpointing rows wrap (may be empty)
    device: torch.device
    autocast_dtype: torch.dtype | None
    tokens_per_step: int | None       # GPT, --hf: batch * seq_len; None for --model
    samples_per_step: int
    _forward_loss: Callable[[], torch.Tensor]

    def loss(self) -> torch.Tensor:
        """Forward pass and loss (a strategy wraps it in its own contexts)."""
        with self.autocast():
            return self._forward_loss()

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def load_module(text: str, what: str, fresh: bool = False):
    """Import ``package.module`` or ``path/to/file.py`` (what: the option, for messages).

    A file is run anew at each call; a module is imported once, or run again with `fresh`
    (a plugin registers its strategies when it runs).

    Raises:
        ValueError: it cannot be imported (the message names the value and the error).
    """
    try:
        if text.endswith(".py"):
            path = os.path.abspath(text)
            mod_spec = importlib.util.spec_from_file_location("_offload_bench_user_module",
                                                              path)
            if mod_spec is None or not os.path.isfile(path):
                raise ImportError(f"no such file: {path}")
            # As `python path/to/file.py` would: the modules beside it are importable.
            if os.path.dirname(path) not in sys.path:
                sys.path.insert(0, os.path.dirname(path))
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
            return module
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # `python -m` semantics: the cwd is importable
        if fresh and text in sys.modules:
            return importlib.reload(sys.modules[text])
        return importlib.import_module(text)
    except Exception as exc:  # the user's module may fail in any way; report it as such
        raise ValueError(f"{what}: cannot import {text!r}: {type(exc).__name__}: {exc}") \
            from exc


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """Resolve ``module:factory`` or ``file.py:factory`` to a callable.

    Raises:
        ValueError: the text has no ``:``, the module/file cannot be imported, or the name is
            missing or not callable (the message names the value and what to do).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected MODULE:FACTORY or FILE.py:FACTORY, "
                         "e.g. --model mypkg.models:build")
    module = load_module(module_name, what=f"--model {spec!r}")
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no callable {attr!r}")
    return factory


def _first_output(out: Any, model: str) -> torch.Tensor:
    """What --model's loss is taken of: the output, or the first element of a tuple, list,
    dict or Hugging Face ModelOutput (an OrderedDict of the fields that are set)."""
    first = out
    if isinstance(out, (tuple, list)) and out:
        first = out[0]
    elif isinstance(out, Mapping) and out:
        first = next(iter(out.values()))
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"--model {model!r}: the model returned {type(out).__name__}"
                        + (f" whose first element is {type(first).__name__}" if first is not out
                           else "")
                        + "; the benchmark's loss needs a tensor (the output, or the first "
                          "element of a tuple, list or dict)")
    return first


def block_names(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """The module names of `blocks` inside `model` (for the row: which blocks ran)."""
    names = {id(m): name for name, m in model.named_modules()}
    return [names.get(id(b), type(b).__name__) for b in blocks]


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module],
                 save_on_cpu_pin_memory: bool | None = None) -> Iterator[None]:
    """Run each block under non-reentrant `torch.utils.checkpoint` while active.

    Args:
        save_on_cpu_pin_memory: None: plain checkpoint (the block inputs stay where they
            are). A bool: each checkpoint call under `torch.autograd.graph.save_on_cpu`
            with that `pin_memory`, as Hugging Face's `offload=True` does.
    """
    originals = []
    for block in blocks:
        forward = block.forward
        originals.append((block, "forward" in block.__dict__, forward))

        def wrapped(*args, _forward=forward, **kwargs):
            if save_on_cpu_pin_memory is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)),
                               "cpu")
            with torch.autograd.graph.save_on_cpu(pin_memory=save_on_cpu_pin_memory,
                                                  device_type=device_type):
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = wrapped  # instance attribute shadows the class method
    try:
        yield
    finally:
        for block, had_own, forward in originals:
            if had_own:
                block.forward = forward
            else:
                del block.forward


def _autocast_dtype(spec: RunSpec) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16}[spec.dtype]


def build_workload(spec: RunSpec) -> Workload:
    """Build the model (seeded) and the fixed batch on `spec.device`."""
    device = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    # The batch comes from its own CPU generator: identical on every device and strategy.
    gen = torch.Generator().manual_seed(spec.seed + 1)
    tokens = None
    if spec.hf is not None:
        from offload.bench import hf

        with torch.device(device):
            model = hf.build(spec.hf)
        seq = spec.hf["seq_len"]
        ids = torch.randint(model.config.vocab_size, (spec.batch, seq), generator=gen).to(device)

        def forward_loss() -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss

        tokens = spec.batch * seq
    elif spec.model is None:
        cfg = GPTConfig(**(spec.gpt or {}))
        with torch.device(device):  # initialise in place: the GPU model is too big for a CPU detour
            model = GPT(cfg)
        idx, targets = model.example_batch(spec.batch, device=device, generator=gen)

        def forward_loss() -> torch.Tensor:
            return model.loss(idx, targets)

        tokens = spec.batch * cfg.seq_len
    else:
        model = load_factory(spec.model)()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {spec.model!r}: the factory returned "
                             f"{type(model).__name__}, not a torch.nn.Module")
        model = model.to(device)
        shape = (spec.batch, *spec.input_shape)
        x = (torch.randn(shape, generator=gen) if spec.input_vocab is None else
             torch.randint(spec.input_vocab, shape, generator=gen)).to(device)

        def forward_loss() -> torch.Tensor:
            try:
                out = model(x)
            except RuntimeError as exc:
                if spec.input_vocab is None and "'indices'" in str(exc):   # an embedding's
                    raise RuntimeError(f"{exc}\n(--model {spec.model!r} ran on torch.randn "
                                       "floats; a model taking token ids needs --input-vocab "
                                       "N)") from exc
                raise
            return _first_output(out, spec.model).float().pow(2).mean()

    model.train()
    return Workload(model=model, blocks=find_blocks(model), device=device,
                    autocast_dtype=_autocast_dtype(spec), tokens_per_step=tokens,
                    samples_per_step=spec.batch, _forward_loss=forward_loss)
