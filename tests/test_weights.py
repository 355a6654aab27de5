"""Weights are recognised by what they are, with or without `model=`: a frozen weight
(LoRA's base model, a frozen backbone) and its views are never moved.

Autograd saves a frozen weight (or `weight.t()`) for the gradient of the activation that
meets it; without `model=` the runtime once took those for activations and copied the whole
base model to the tier every step.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import offload
from offload.runtime.storing import Storer


@contextlib.contextmanager
def moved_storages():
    """The data pointers of every storage the hooks stored (moved or kept) in the block."""
    seen: list[int] = []
    original = Storer.store

    def spy(self, t, storage, *args, **kwargs):
        record = original(self, t, storage, *args, **kwargs)
        if record.payload is not None:
            seen.append(storage.data_ptr())
        return record

    Storer.store = spy
    try:
        yield seen
    finally:
        Storer.store = original


def _weights(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


class _Adapted(nn.Module):
    """A frozen base linear plus a trainable low-rank adapter (LoRA by hand)."""

    def __init__(self, d: int = 64, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _frozen_stack():
    torch.manual_seed(0)
    return nn.Sequential(_Adapted(), nn.GELU(), _Adapted(), nn.GELU(), _Adapted())


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_frozen_weights_stay_without_model(tiers, nvme_dir):
    model = _frozen_stack()
    x = torch.randn(8, 64)
    with moved_storages() as moved:
        with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
            model(x).pow(2).sum().backward()
    assert ctx.stats.offloaded_tensors > 0            # the activations did move
    assert not _weights(model) & set(moved), "a frozen weight was moved"
    assert ctx.stats.param_tensors >= 3               # base.weight.t() of each layer


def test_frozen_weights_train_exactly_without_model(nvme_dir):
    def train(use):
        model = _frozen_stack()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(5):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            ctx = offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) if use \
                else contextlib.nullcontext()
            with ctx:
                model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()
    ref, got = train(False), train(True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_frozen_parameter_view_is_a_weight():
    from offload.runtime.tensor_meta import is_weight

    w = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    assert is_weight(w) and is_weight(w.t()) and is_weight(w[1:])
    activation = torch.randn(4, 4, requires_grad=True) * 2
    assert not is_weight(activation) and not is_weight(torch.randn(3))
    assert not is_weight(activation[1:])


def test_peft_lora_on_llama_moves_no_base_weight_without_model(nvme_dir):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(128, (2, 16))
    with moved_storages() as moved:
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
            model(input_ids=ids, labels=ids).loss.backward()
    assert ctx.stats.offloaded_tensors > 0
    assert not _weights(model) & set(moved), \
        f"{len(_weights(model) & set(moved))} weight storages were moved"
