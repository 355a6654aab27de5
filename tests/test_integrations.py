"""Training-stack integrations, what only a test inside the process can see: Hugging Face
Trainer's micro-batches run inside the offload context and its evaluation outside it
(OffloadTrainerMixin), and so do TRL SFTTrainer's with a LoRA model; Lightning's
OffloadCallback leaves nothing installed when training raises. That each framework trains
bit-exact with offload, bytes really moved, is checked by its example's `--check`
(tests/test_examples.py: hf_trainer, accelerate_loop, lightning_callback, trl_sft).

The frameworks are optional dependencies (extras `hf`, `lightning`; the `test` extra
installs them): a test whose framework is not installed skips with the reason.
"""
from __future__ import annotations

import os

import pytest
import torch

import offload
from offload._ext import core_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not core_available(), reason="offload._C unavailable")]


def _gpt2(transformers):
    """A 2-layer GPT-2 from a config (no download), with dropout."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                  n_head=4)
    return transformers.GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 32) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(128, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ---------------------------------------------------------------- Hugging Face Trainer
def _hf_train(tmp_path, trainer_cls, **extra):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    model = _gpt2(transformers)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
        gradient_accumulation_steps=2, learning_rate=1e-2, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    trainer = trainer_cls(model=model, args=args, train_dataset=_Tokens(), **extra)
    trainer.train()
    return trainer, [p.detach().clone() for p in model.parameters()]


def test_hf_trainer_mixin_installs_nothing_in_evaluation(tmp_path, nvme_dir):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from offload.integrations.transformers import OffloadTrainerMixin

    seen = []

    class OffloadTrainer(OffloadTrainerMixin, transformers.Trainer):
        offload_settings = {"tiers": "nvme", "nvme_dir": nvme_dir, "min_bytes": 0}

        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(self.offload_context.active)
            return super().compute_loss(model, inputs, *args, **kwargs)

    trainer, _ = _hf_train(tmp_path, OffloadTrainer, eval_dataset=_Tokens(n=4))
    n_train = len(seen)
    assert n_train == 6 and all(seen)            # 3 steps x 2 micro-batches, each inside it
    assert trainer.offload_context.stats.nvme_bytes > 0 and not trainer.offload_context.active
    trainer.evaluate()
    assert len(seen) > n_train and not any(seen[n_train:])


def test_hf_trainer_mixin_after_trainer_in_the_bases_is_refused():
    """With the mixin after Trainer, Trainer's `compute_loss_context_manager` runs and calls
    no super(): training ran without offload and nothing said so (a helper's report)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from offload.integrations.transformers import OffloadTrainerMixin

    class Mine(transformers.Trainer):
        pass

    with pytest.raises(TypeError, match=r"class Wrong: put OffloadTrainerMixin before Mine "
                                        r"in the bases \(class Wrong\(OffloadTrainerMixin, Mine"):
        class Wrong(Mine, OffloadTrainerMixin):
            pass

    class Right(OffloadTrainerMixin, Mine):
        pass

    class OwnMixin(OffloadTrainerMixin):   # a user's mixin on ours: named as written
        pass

    with pytest.raises(TypeError, match=r"put OwnMixin before Mine in the bases"):
        class AlsoWrong(Mine, OwnMixin):
            pass

    class Further(Right):   # a subclass of a right one, its own override calling super()
        def compute_loss_context_manager(self):
            return super().compute_loss_context_manager()


# ---------------------------------------------------------------- TRL SFTTrainer (+ peft)
def _sft_parts(transformers):
    """A tiny Llama, a word-level tokenizer made here and a text dataset (no download)."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{j}" for j in torch.randint(61, (40,), generator=g).tolist())
             for _ in range(8)]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=2, bos_token_id=None))
    return model, tokenizer, datasets.Dataset.from_dict({"text": texts})


def test_trl_sft_trainer_runs_each_micro_batch_inside(tmp_path, nvme_dir, caplog):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    trl = pytest.importorskip("trl", reason="trl is not installed")
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from offload.integrations.transformers import OffloadTrainerMixin

    seen = []

    class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
        offload_settings = {"tiers": "nvme", "nvme_dir": nvme_dir, "min_bytes": 0}

        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(self.offload_context.active)
            return super().compute_loss(model, inputs, *args, **kwargs)

    model, tokenizer, data = _sft_parts(transformers)
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, max_length=64, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    trainer = OffloadSFTTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data.select(range(2)),
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                    task_type="CAUSAL_LM"))
    trainer.train()
    assert seen == [True] * 4                   # 2 steps x 2 micro-batches, each inside
    stats = trainer.offload_context.stats
    assert stats.nvme_bytes > 0 and not trainer.offload_context.active
    trainer.evaluate()
    assert len(seen) > 4 and not any(seen[4:])  # evaluation runs outside
    # TRL's own offload alongside ours: it would find nothing to move; said once.
    trainer._offload_context = None
    trainer.args.activation_offloading = True
    with caplog.at_level("WARNING", logger="offload"):
        trainer.offload_context
    assert "SFTConfig(activation_offloading=True) has no effect under OffloadTrainerMixin" \
        in caplog.text


# ---------------------------------------------------------------- Lightning
def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning",
                                 reason="neither lightning nor pytorch_lightning is installed")
    return pl


def _lightning_train(tmp_path, callbacks, fail_at: int | None = None,
                     skip_from: int | None = None):
    pl = _lightning()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            from offload.bench.models import GPT, GPTConfig

            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab_size=128, hidden=64, layers=2, heads=4, seq_len=32))

        def training_step(self, batch, batch_idx):
            if batch_idx == fail_at:
                raise RuntimeError("boom")
            ids = batch["input_ids"]
            return self.gpt.loss(ids, ids)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == skip_from:
                return -1   # Lightning's way to end the epoch here

    pl.seed_everything(0, verbose=False)
    module = Module()
    # (An epoch that ends at `skip_from` never reaches max_steps: one epoch then.)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
                         max_epochs=None if skip_from is None else 1,
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(_Tokens(), batch_size=2))
    return [p.detach().clone() for p in module.parameters()]


def test_lightning_callback_exits_on_an_exception(tmp_path, nvme_dir):
    _lightning()
    from offload.integrations.lightning import OffloadCallback

    callback = OffloadCallback(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    with pytest.raises(RuntimeError, match="boom"):
        _lightning_train(tmp_path, [callback], fail_at=1)
    assert not callback.context.active
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert os.listdir(nvme_dir) == []


def test_lightning_callback_ends_its_block_when_the_module_ends_the_epoch(tmp_path, nvme_dir):
    """A module's `on_train_batch_start` returning -1 ends the epoch after our callback
    entered, and Lightning calls no `on_train_batch_end`: the context stayed entered after
    `fit()` (its hooks packed every later save of the thread; a second `fit()` raised
    "already active"; a helper's report). It ends with the epoch now."""
    _lightning()
    from offload.integrations.lightning import OffloadCallback

    callback = OffloadCallback(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    for _ in range(2):   # the second fit enters the same context again
        _lightning_train(tmp_path, [callback], skip_from=1)
        assert not callback.context.active
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert os.listdir(nvme_dir) == []



# ---------------------------------------------------------------- a new model, the same hook
def test_hf_trainer_mixin_follows_the_model_that_model_init_makes(tmp_path):
    """`Trainer(model_init=...)` builds a new `trainer.model` at every `train()`
    (`hyperparameter_search`: one per trial); the mixin's context was made once, with
    `model=` the first, so from the second `train()` on `recompute` found no block of the
    model it ran (about 11x the saved bytes) and kept the first model alive (a helper's
    report). Each `train()` now saves what the first did."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from offload.integrations.transformers import OffloadTrainerMixin

    class OffloadTrainer(OffloadTrainerMixin, transformers.Trainer):
        offload_settings = {"policy": "recompute", "tiers": "host"}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    def model_init():
        model = _gpt2(transformers)
        model.config.use_cache = False   # (a cache in the forward: no block re-runs, README)
        return model

    trainer = OffloadTrainer(model_init=model_init, args=args, train_dataset=_Tokens())
    saved, models = [], []
    for _ in range(2):
        trainer.train()
        saved.append(trainer.offload_context.stats.saved_bytes)
        models.append(trainer.model)
    assert saved[0] == saved[1] > 0
    assert models[0] is not models[1] and trainer.offload_context.model is models[1]


def test_lightning_callback_reused_for_another_module_follows_it(tmp_path):
    """One OffloadCallback passed to a second `fit()` of a new module (a sweep, k-fold): its
    context kept `model=` the first module, so `recompute` re-ran no block of the second
    (about 11x the saved bytes; a helper's report). Each fit now saves what the first did."""
    _lightning()
    from offload.integrations.lightning import OffloadCallback

    callback = OffloadCallback(policy="recompute", tiers="host")
    saved, contexts = [], []
    for _ in range(2):
        _lightning_train(tmp_path, [callback])
        saved.append(callback.context.stats.saved_bytes)
        contexts.append(callback.context)
    assert saved[0] == saved[1] > 0
    assert contexts[0] is not contexts[1]
