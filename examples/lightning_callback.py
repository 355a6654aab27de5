"""Lightning with activation offload: one callback.

    pip install "offload[lightning]"
    python examples/lightning_callback.py --check

`OffloadCallback(**settings)` wraps every training batch (forward, backward, optimizer
step) in `offload.activations()`; an exception in training exits it cleanly.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import pytorch_lightning as pl
import torch

import offload
from offload.integrations.lightning import OffloadCallback
from offload.models import GPT, GPTConfig


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tiers", default=os.environ.get("OFFLOAD_TIERS", "nvme"))
    p.add_argument("--check", action="store_true",
                   help="train again without the callback and compare the weights bit for bit")
    args = p.parse_args()

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
            plain = train(args, [])
            same = all(torch.equal(a, b) for a, b in zip(weights, plain))
            print("weights vs no offload:", "bit-exact" if same else "DIFFERENT")
            if not same:
                raise SystemExit(1)
    finally:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
