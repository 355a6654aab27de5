"""The model, the fixed batch and the loss a worker trains on.

Built-in: the GPT of :mod:`offload.models` (``loss = cross-entropy of next-token targets``).

``--model module:factory`` (or ``path/to/file.py:factory``): ``factory()`` returns an
``nn.Module``; the input is ``torch.randn(batch, *input_shape)`` and the loss is
``output.float().pow(2).mean()`` (for a tuple/list output, of its first element). The loss is
arbitrary but fixed, which is all a memory/time/gradient comparison needs.

``recompute`` checkpoints "blocks": the GPT's layers; for ``--model``, the members of the
module's largest ``nn.ModuleList`` (by parameter count), else the children of its largest
``nn.Sequential``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from offload.bench.spec import RunSpec
from offload.models import GPT, GPTConfig

__all__ = ["Workload", "build_workload", "load_factory", "find_blocks"]


@dataclasses.dataclass
class Workload:
    """A model on its device plus a loss closure over one fixed batch."""

    model: nn.Module
    blocks: list[nn.Module]           # what `recompute` checkpoints (may be empty)
    device: torch.device
    autocast_dtype: torch.dtype | None
    tokens_per_step: int | None       # GPT: batch * seq_len; None for --model
    samples_per_step: int
    _forward_loss: Callable[[bool], torch.Tensor]

    def loss(self, recompute: bool = False) -> torch.Tensor:
        """Forward pass and loss; `recompute` checkpoints every block (saves only its input)."""
        with self.autocast():
            return self._forward_loss(recompute)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


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
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            mod_spec = importlib.util.spec_from_file_location("_offload_bench_user_model", path)
            if mod_spec is None or not os.path.isfile(path):
                raise ImportError(f"no such file: {path}")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # `python -m` semantics: the cwd is importable
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way; report it as such
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no callable {attr!r}")
    return factory


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of `model` that `recompute` should checkpoint (see module doc)."""
    def nparams(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        return list(max(lists, key=nparams))
    seqs = [m for m in model.modules() if isinstance(m, nn.Sequential) and len(m) > 1]
    if seqs:
        return list(max(seqs, key=nparams))
    return []


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module]) -> Iterator[None]:
    """Run each block under non-reentrant `torch.utils.checkpoint` while active."""
    originals = []
    for block in blocks:
        forward = block.forward
        originals.append((block, "forward" in block.__dict__, forward))

        def wrapped(*args, _forward=forward, **kwargs):
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
    if spec.model is None:
        cfg = GPTConfig(**(spec.gpt or {}))
        with torch.device(device):  # initialise in place: the GPU model is too big for a CPU detour
            model = GPT(cfg)
        idx, targets = model.example_batch(spec.batch, device=device, generator=gen)

        def forward_loss(recompute: bool) -> torch.Tensor:
            return model.loss(idx, targets, checkpoint_blocks=recompute)

        blocks = list(model.blocks)
        tokens = spec.batch * cfg.seq_len
    else:
        model = load_factory(spec.model)()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {spec.model!r}: the factory returned "
                             f"{type(model).__name__}, not a torch.nn.Module")
        model = model.to(device)
        x = torch.randn((spec.batch, *spec.input_shape), generator=gen).to(device)
        blocks = find_blocks(model)

        def forward_loss(recompute: bool) -> torch.Tensor:
            ctx = checkpointed(blocks) if recompute else contextlib.nullcontext()
            with ctx:
                out = model(x)
            if isinstance(out, (tuple, list)):
                out = out[0]
            return out.float().pow(2).mean()

        tokens = None
    model.train()
    return Workload(model=model, blocks=blocks, device=device,
                    autocast_dtype=_autocast_dtype(spec), tokens_per_step=tokens,
                    samples_per_step=spec.batch, _forward_loss=forward_loss)
