"""Lightning: a callback that offloads the activations of every training batch.

    import pytorch_lightning as pl        # or: import lightning.pytorch as pl
    from offload.integrations.lightning import OffloadCallback

    trainer = pl.Trainer(callbacks=[OffloadCallback(tiers="nvme")])
    trainer.fit(module, data)

Lightning calls `on_train_batch_start` before the batch's `training_step` and
`on_train_batch_end` after its backward and optimizer step, on the same thread, so one
offload block spans exactly one batch; with gradient accumulation every batch is its own
block. A batch whose module's `on_train_batch_start` returns -1 (the epoch ends there) ends
its block at the epoch's end. When training raises, `on_exception` exits the block with the
exception, which frees its tiers and hooks. Validation and prediction run outside it.

The callback subclasses the `Callback` of whichever Lightning the process imported first
(`lightning.pytorch` or `pytorch_lightning`): Lightning only accepts its own class.
"""
from __future__ import annotations

import sys
from typing import Any

from ..context import ActivationOffload, activations

__all__ = ["OffloadCallback"]


def _callback_base() -> type:
    for name in ("lightning.pytorch", "pytorch_lightning"):  # the one already in use first
        if name in sys.modules:
            return sys.modules[name].Callback
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            raise ImportError("offload.integrations.lightning needs Lightning: pip install "
                              "pytorch-lightning (or lightning)") from None
    return pl.Callback


class _OffloadCallback:
    """Offload each training batch's activations (`offload.activations(**settings)`).

    Args:
        **settings: Keyword arguments of `offload.activations()`; they win over the
            OFFLOAD_* variables. `enabled=False` (or OFFLOAD_ENABLED=0) turns it off.

    Attributes:
        context: The context reused for every batch; `context.stats` is the latest batch's.
            A fit of another module makes a new one (`model=` that module).
    """

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self._settings = settings
        self.context: ActivationOffload | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and (self.context is None or self.context.model is not pl_module):
            # Settings are checked here, before the first batch touches anything. A callback
            # reused for another module's fit (a sweep, k-fold) gets a context of its own:
            # the last one's `model=` names the other module's blocks and parameters
            # (`recompute` re-ran nothing here), and would keep that module alive.
            self.context = activations(model=pl_module, **self._settings)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.context.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._leave()

    # A LightningModule whose `on_train_batch_start` returns -1 ends the epoch there, after
    # ours entered, and Lightning calls no `on_train_batch_end`: the block ends with the
    # epoch (or the fit), or it stayed entered, its hooks on the thread for good.
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._leave()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._leave()

    def _leave(self) -> None:
        if self.context is not None and self.context.active:
            self.context.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.context is not None and self.context.active:
            self.context.__exit__(type(exception), exception, exception.__traceback__)


_classes: dict[type, type] = {}


def __getattr__(name: str):
    # Built at first use, on the Lightning the process is using (module docstring).
    if name == "OffloadCallback":
        base = _callback_base()
        if base not in _classes:
            _classes[base] = type("OffloadCallback", (_OffloadCallback, base),
                                  {"__doc__": _OffloadCallback.__doc__,
                                   "__module__": __name__})
        return _classes[base]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
