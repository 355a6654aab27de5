"""An accelerate training loop with activation offload.

    pip install "offload[hf]"
    python examples/accelerate_loop.py --check

accelerate needs nothing special: put `offload.activations()` around the forward and
`accelerator.backward`, inside `accelerator.accumulate` when accumulating gradients.
`enabled=` turns it off with one flag.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from support import check_weights, example_parser


def train(args, nvme_dir: str, use_offload: bool) -> list[torch.Tensor]:
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(args.vocab, (4 * args.steps * args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(ids, batch_size=args.batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ctx = offload.activations(model=model, tiers=args.tiers, nvme_dir=nvme_dir,
                              enabled=use_offload)
    for step, batch in zip(range(2 * args.steps), loader):
        with accelerator.accumulate(model):
            with ctx:
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if use_offload and accelerator.is_main_process:
            s = ctx.stats
            print(f"micro-batch {step}: loss {loss.item():.4f}, saved {s.saved_bytes >> 20} "
                  f"MiB, nvme {s.nvme_bytes >> 20} MiB, stall {s.stall_s:.3f} s")
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def main() -> None:
    p = example_parser(__doc__, steps=4, tiers="nvme")
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()

    nvme_dir = tempfile.mkdtemp(prefix="offload-accelerate-", dir="/var/tmp")
    try:
        weights = train(args, os.environ.get("OFFLOAD_NVME_DIR") or nvme_dir, True)
        offload.empty_cache()
        if args.check:
            check_weights(weights, train(args, nvme_dir, False))
    finally:
        shutil.rmtree(nvme_dir)


if __name__ == "__main__":
    main()
