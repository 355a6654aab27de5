"""Lightning with activation offload: one callback.

    pip install "offload[lightning]"
    python examples/lightning_callback.py --check

`OffloadCallback(**settings)` wraps every training batch (forward, backward, optimizer
step) in `offload.activations()`; an exception in training exits it cleanly.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytorch_lightning as pl
import torch

import offload
from support import check_weights, example_parser
from offload.integrations.lightning import OffloadCallback
from offload.bench.models import GPT, GPTConfig


class LitGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(cfg)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = self.gpt.loss(idx, targets)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def train(args, callbacks) -> list[torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                    seq_len=args.seq_len)
    module = LitGPT(cfg)
    g = torch.Generator().manual_seed(1)
    n = 2 * args.steps * args.batch
    data = torch.utils.data.TensorDataset(torch.randint(cfg.vocab_size, (n, cfg.seq_len),
                                                        generator=g),
                                          torch.randint(cfg.vocab_size, (n, cfg.seq_len),
                                                        generator=g))
    trainer = pl.Trainer(max_steps=args.steps, accumulate_grad_batches=2, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.work)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.batch))
    return [p.detach().clone() for p in module.parameters()]


def main() -> None:
    args = example_parser(__doc__, steps=4, tiers="nvme", check_help="train again without "
                          "the callback and compare the weights bit for bit").parse_args()

    args.work = tempfile.mkdtemp(prefix="offload-lightning-", dir="/var/tmp")
    try:
        callback = OffloadCallback(tiers=args.tiers,
                                   nvme_dir=os.environ.get("OFFLOAD_NVME_DIR") or args.work)
        weights = train(args, [callback])
        s = callback.context.stats
        print(f"last batch: saved {s.saved_bytes >> 20} MiB, nvme {s.nvme_bytes >> 20} MiB, "
              f"stall {s.stall_s:.3f} s")
        offload.empty_cache()
        if args.check:
            check_weights(weights, train(args, []))
    finally:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
