"""Hugging Face `Trainer`: offload the activations of every training micro-batch.

    from transformers import Trainer
    from offload.integrations.transformers import OffloadTrainerMixin

    class OffloadTrainer(OffloadTrainerMixin, Trainer):   # mixin first
        offload_settings = {"tiers": "nvme"}               # optional; OFFLOAD_* otherwise

    trainer = OffloadTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.offload_context.stats                           # the latest micro-batch's

`Trainer.training_step` runs the forward inside `compute_loss_context_manager()` and the
backward (`accelerator.backward`) right after it; the mixin adds the offload context to
that manager. So the context covers each micro-batch's forward, its backward runs after the
exit, and the step ends at autograd's end-of-backward callback (NOTE [End of step] in
offload/runtime/step.py). Works with a `Trainer` subclass that keeps Trainer's `training_step` (or
calls `compute_loss_context_manager` around its forward), and under torchrun, where
Trainer runs DDP through accelerate (examples/hf_trainer.py: bit-exact on 2 gloo ranks).
Evaluation (no gradients) installs nothing. TRL's `SFTTrainer` is such a subclass
(examples/trl_sft.py: LoRA via peft, bit-exact); its own `activation_offloading=True` then
has nothing left to move (ours are the innermost hooks), which the mixin logs once.

An accelerate loop without Trainer needs no integration:

    with offload.activations(model=model):
        loss = model(**batch).loss
        accelerator.backward(loss)
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..context import ActivationOffload, activations

__all__ = ["OffloadTrainerMixin"]

log = logging.getLogger("offload")


class OffloadTrainerMixin:
    """Put before `transformers.Trainer` (or a subclass) in the bases (after it, a TypeError
    at the class statement: Trainer's method would run instead, and nothing be offloaded).

    Attributes:
        offload_settings: Keyword arguments of `offload.activations()` (same names as the
            OFFLOAD_* variables, lower case without the prefix); they win over the
            environment. `{"enabled": False}` (or OFFLOAD_ENABLED=0) turns it off.
    """

    offload_settings: dict[str, Any] = {}
    _offload_context: ActivationOffload | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # `class T(Trainer, OffloadTrainerMixin)` trains without offload and says nothing:
        # transformers' `compute_loss_context_manager` comes first and calls no super().
        mro = cls.__mro__
        ours = mro.index(OffloadTrainerMixin)
        for base in mro[:ours]:
            if base.__module__.split(".")[0] == "transformers" \
                    and "compute_loss_context_manager" in vars(base):
                given = next((b for b in cls.__bases__ if issubclass(b, base)), base).__name__
                mixin = next((b for b in cls.__bases__ if issubclass(b, OffloadTrainerMixin)),
                             OffloadTrainerMixin).__name__
                raise TypeError(f"class {cls.__name__}: put {mixin} before {given} in the "
                                f"bases (class {cls.__name__}({mixin}, {given})); after it, "
                                f"{base.__name__}.compute_loss_context_manager runs instead "
                                "of the mixin's and nothing is offloaded")

    @property
    def offload_context(self) -> ActivationOffload:
        """The context reused for every micro-batch (made, and its settings checked, at
        first use), and made again when `self.model` is another model: `train()` with
        `model_init` (or `hyperparameter_search`, a trial per call) builds a new one, which
        the last context's `model=` did not name (its blocks were not re-run)."""
        context = self._offload_context
        if context is None or context.model is not self.model:
            self._offload_context = activations(model=self.model, **self.offload_settings)
            args = getattr(self, "args", None)
            if context is None and self._offload_context.config.enabled \
                    and getattr(args, "activation_offloading", False):
                # TRL's hooks wrap training_step; ours, entered later around the forward, are
                # innermost, so every saved tensor comes to us and none to them.
                log.warning("offload: %s(activation_offloading=True) has no effect under "
                            "OffloadTrainerMixin: offload moves every saved activation; set "
                            "activation_offloading=False", type(args).__name__)
        return self._offload_context

    def compute_loss_context_manager(self):
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        # prediction_step uses the same manager under no_grad: nothing is saved there.
        if torch.is_grad_enabled():
            stack.enter_context(self.offload_context)
        return stack
