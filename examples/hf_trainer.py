"""Hugging Face Trainer with activation offload; a small GPT-2 built from a config.

    pip install "offload[hf]"   # transformers, accelerate
    python examples/hf_trainer.py --check
    torchrun --nproc-per-node 2 examples/hf_trainer.py          # Trainer runs DDP itself

The integration is one mixin before `Trainer` in the bases: each training micro-batch's
forward runs inside `offload.activations()` (Trainer's `compute_loss_context_manager`),
and its backward ends the offload step. Settings come from OFFLOAD_* variables, or from
`offload_settings`. No download: the model is built from a config with random weights and
trained on random tokens.
"""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from support import example_parser, run_trainer_example
from offload.integrations.transformers import OffloadTrainerMixin


class OffloadTrainer(OffloadTrainerMixin, Trainer):
    pass


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.ids = torch.randint(vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(args, out_dir: str, trainer_cls) -> tuple[list[torch.Tensor], Trainer]:
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
        gradient_accumulation_steps=2, learning_rate=3e-4, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available())
    trainer = trainer_cls(model=model, args=training,
                          train_dataset=RandomTokens(8 * args.batch, args.seq_len, args.vocab))
    trainer.train()
    return [p.detach().clone() for p in model.parameters()], trainer


def main() -> None:
    p = example_parser(__doc__, steps=4, tiers="nvme", check_help="train again with a plain "
                       "Trainer and compare the weights bit for bit")
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()
    run_trainer_example(args, train, OffloadTrainer, Trainer, "offload-hf-")


if __name__ == "__main__":
    main()
