"""Small models and a step runner shared by the scheduler tests (not a test module).

`compare_steps` runs N training steps of a model twice from the same weights and seeds,
once plainly and once inside a fresh offload context per step, and returns the first step
whose gradients differ bit for bit (None when all are identical). No optimizer update:
every step sees the same weights, so a difference anywhere is the runtime's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import offload
from offload.bench.models import GPT, GPTConfig

# Probe figures of a slow disk and fast compute: `auto` then recomputes rather than moves.
SLOW = "compute_gflops=100,dispatch_op_s=1e-6,nvme_write_gbps=1e-4,nvme_read_gbps=1e-4,nvme_issue_s=1e-6"

__all__ = ["SLOW",
           "small_gpt", "compare_steps", "hf_gpt2", "hf_llama", "RandomBlock", "RandomStack",
           "random_stack", "SharedLayers", "module_state", "first_difference",
           "train_side_by_side"]


def small_gpt(layers: int = 3, hidden: int = 64, seq: int = 32, dropout: float = 0.1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, hidden=hidden, layers=layers, heads=4, seq_len=seq,
                          dropout=dropout))
    idx, tgt = model.example_batch(2, generator=torch.Generator().manual_seed(1))
    return model, lambda: model.loss(idx, tgt)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                       vocab_size=128, resid_pdrop=0.1, attn_pdrop=0.1,
                                       embd_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    model.train()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied embeddings
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model.train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss


class RandomBlock(nn.Module):
    """Random ops that are single ops (functional dropout, rand_like): their outputs may be
    stored, so replaying them exactly needs the RNG restore (stored_ops.py Rule 2)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x):
        h, _ = torch.ops.aten.native_dropout(self.a(x), 0.3, True)
        h = torch.nn.functional.gelu(h) * (torch.rand_like(h) > 0.2)
        h, _ = torch.ops.aten.native_dropout(self.b(h), 0.3, True)
        return x + h


class RandomStack(nn.Module):
    def __init__(self, n: int = 3, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RandomBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class SharedLayers(nn.Module):
    """ALBERT-style weight sharing: one layer object at every position of the stack."""

    def __init__(self, positions: int = 4, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, d)
        layer = _Layer(d)
        self.layers = nn.ModuleList([layer] * positions)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def random_stack():
    torch.manual_seed(0)
    model = RandomStack()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    return model, lambda: model(x).pow(2).mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def compare_steps(model: nn.Module, loss_fn, steps: int, **settings) -> tuple:
    """(first differing step or None, the last context) over `steps` steps."""
    reference = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss_fn().backward()
        reference.append(_grads(model))
    ctx = None
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        ctx = offload.activations(model=model, **settings)
        with ctx:
            loss_fn().backward()
        grads = _grads(model)
        if len(grads) != len(reference[step]) or \
                not all(torch.equal(a, b) for a, b in zip(grads, reference[step])):
            return step, ctx
    return None, ctx


# ---------------------------------------------------------------- training side by side
def module_state(model: nn.Module) -> dict:
    """What a module carries besides its tensors: attribute names and hook counts per
    submodule (a wrapper left on a module, a hook not removed, shows here)."""
    return {name: sorted((k, len(v) if isinstance(v, dict) else None)
                         for k, v in vars(m).items())
            for name, m in model.named_modules(remove_duplicate=False)}


def tensors_of(model: nn.Module) -> dict:
    """Parameters and buffers by name; a lazy one that has not run yet has no value."""
    from torch.nn.parameter import is_lazy

    return {**{f"param {n}": p for n, p in model.named_parameters() if not is_lazy(p)},
            **{f"buffer {n}": b for n, b in model.named_buffers() if not is_lazy(b)}}


def first_difference(a: nn.Module, b: nn.Module, grads: bool = False) -> str | None:
    """Name of the first parameter (or its gradient) or buffer that differs bit for bit."""
    ta, tb = tensors_of(a), tensors_of(b)
    if ta.keys() != tb.keys():
        return "the models' tensors have other names"
    for name, x in ta.items():
        y = tb[name]
        if grads:
            if name.startswith("param") and x.requires_grad and \
                    ((x.grad is None) != (y.grad is None)
                     or (x.grad is not None and not torch.equal(x.grad, y.grad))):
                return f"grad of {name}"
        elif not torch.equal(x, y):
            return name
    return None


def train_side_by_side(model: nn.Module, loss_fn, steps: int, settings: dict,
                       lr: float = 1e-3, each=None, pass_model: bool = True,
                       plain: nn.Module | None = None) -> tuple:
    """Train a copy of `model` plainly and `model` inside a fresh offload context per step,
    AdamW, the same seed per step (dropout masks); stop at the first step whose gradients,
    weights or buffers differ bit for bit.

    `loss_fn(model)` runs the forward; `each(step, ctx)` checks more after each step (or
    changes both models: swaps a module in each);
    `plain`: the model trained plainly, built like `model` (a lazy one cannot be copied).
    Returns (first differing step and what, or None; the last context)."""
    import copy

    plain = copy.deepcopy(model) if plain is None else plain
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
            for m in (plain, model)]
    ctx = None
    for step in range(steps):
        for m, opt in zip((plain, model), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            if m is plain:
                loss_fn(m).backward()
            else:
                ctx = offload.activations(model=m if pass_model else None, **settings)
                with ctx:
                    loss_fn(m).backward()
        what = first_difference(plain, model, grads=True)
        for opt in opts:
            opt.step()
        what = what or first_difference(plain, model)
        if what is not None:
            return (step, what), ctx
        # Against the plain model, which changes itself as this one does (a lazy module
        # made plain, a hook its forward registers), but carries nothing of offload's.
        assert module_state(model) == module_state(plain), \
            f"step {step}: offload left something on the model"
        if each is not None:
            each(step, ctx)
    return None, ctx
