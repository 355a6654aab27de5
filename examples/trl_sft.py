"""TRL's SFTTrainer with activation offload: LoRA (peft) fine-tuning of a small Llama.

    pip install "offload[hf]" trl peft
    python examples/trl_sft.py --check

`SFTTrainer` keeps `Trainer.training_step`, so the same mixin as for a plain `Trainer`
(offload/integrations/transformers.py) puts each micro-batch's forward inside
`offload.activations()`; the backward ends the offload step. With LoRA most weights are
frozen, yet autograd still saves every layer's activations for the adapters' gradients:
those are what move. No download: a Llama built from a config with random weights, a
word-level tokenizer made here, and random "sentences" of its words.
"""
from __future__ import annotations

import torch
from datasets import Dataset, disable_progress_bars
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from support import example_parser, run_trainer_example
from offload.integrations.transformers import OffloadTrainerMixin


class OffloadSFTTrainer(OffloadTrainerMixin, SFTTrainer):  # the mixin first
    pass


def tokenizer_and_texts(words: int, n: int, seq_len: int):
    """A word-level tokenizer over `words` made-up words, and `n` random lines of them."""
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="</s>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 4, seq_len - 1, (n,), generator=g)  # room for </s>
    texts = [" ".join(f"w{j}" for j in torch.randint(words, (int(k),), generator=g).tolist())
             for k in lengths]
    return tokenizer, Dataset.from_dict({"text": texts})


def train(args, out_dir: str, trainer_cls) -> tuple[list[torch.Tensor], SFTTrainer]:
    tokenizer, data = tokenizer_and_texts(args.words, 8 * args.batch, args.seq_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq_len,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None))
    config = SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
        gradient_accumulation_steps=2, learning_rate=1e-3, max_length=args.seq_len,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = trainer_cls(model=model, args=config, train_dataset=data,
                          processing_class=tokenizer, peft_config=lora)
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()], trainer


def main() -> None:
    p = example_parser(__doc__, steps=4, tiers="nvme", check_help="train again with a plain "
                       "SFTTrainer and compare the weights (adapters and base) bit for bit")
    p.add_argument("--words", type=int, default=200, help="the tokenizer's made-up words")
    args = p.parse_args()
    disable_progress_bars()  # the dataset preparation's bars, once per run
    run_trainer_example(args, train, OffloadSFTTrainer, SFTTrainer, "offload-trl-")


if __name__ == "__main__":
    main()
