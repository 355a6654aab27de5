"""Built-in models for tests and the benchmark.

`GPT` is a small GPT-2-style decoder (tied embeddings, dropout, fused
scaled-dot-product attention).  `MLP` and `ConvNet`
(with BatchNorm) are the other shapes the gradient checks cover.  `gpt_for_machine`
picks a size that fits the device the benchmark runs on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "MLP", "ConvNet", "gpt_for_machine"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1024
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    seq_len: int = 512
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a whole number of at "
                                 "least 1")
        if not 0.0 <= self.dropout <= 1.0:  # nn.Dropout's range
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be a probability "
                             "from 0 to 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not divisible by heads={self.heads}"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, heads, s, head_dim): transposed views, as real GPT code saves them.
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        # SDPA picks the fused CPU/GPU kernel; with dropout it consumes the RNG, which
        # checkpoint's replay restores, so recompute stays bit-exact.
        drop = self.attn_drop.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """One transformer layer; the unit that checkpointing and planning repeat over."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, 4 * cfg.hidden),
            nn.GELU(),
            nn.Linear(4 * cfg.hidden, cfg.hidden),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _gpt2_init(module: nn.Module) -> None:
    # GPT-2's: N(0, 0.02) weights, zero biases. With torch's N(0, 1) embeddings, tied to
    # the head, the first loss was 40-157 instead of about ln(vocab_size).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: autograd saves views of it
        self.apply(_gpt2_init)


    def forward(self, idx: torch.Tensor, checkpoint_blocks: bool | str = False) -> torch.Tensor:
        """Return logits; `checkpoint_blocks` recomputes every block in backward (True:
        torch.utils.checkpoint's non-reentrant mode; "reentrant": the reentrant one)."""
        _, s = idx.shape
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if checkpoint_blocks:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=checkpoint_blocks == "reentrant")
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor,
             checkpoint_blocks: bool | str = False):
        logits = self(idx, checkpoint_blocks=checkpoint_blocks)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def example_batch(self, batch: int, device="cpu", generator: torch.Generator | None = None):
        """Random token ids and next-token targets of the configured sequence length."""
        shape = (batch, self.cfg.seq_len)
        idx = torch.randint(self.cfg.vocab_size, shape, generator=generator).to(device)
        targets = torch.randint(self.cfg.vocab_size, shape, generator=generator).to(device)
        return idx, targets


class MLP(nn.Module):
    def __init__(self, d_in: int = 256, hidden: int = 1024, depth: int = 4, d_out: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """A small CNN with BatchNorm (running stats are buffers: they must never move)."""

    def __init__(self, channels: int = 32, classes: int = 10):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def gpt_for_machine(device: torch.device | str = "cpu") -> tuple[GPTConfig, int]:
    """A GPT config and batch size sized for `device`.

    CPU: the issue's reference size (~2 GB of saved activations at batch 8, a few seconds a
    step on 2 cores; offload-bench runs it at batch 3 unless --batch says otherwise, so its
    default run is short).  CUDA: scaled with the device's memory so activations dominate.
    """
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if total >= 60 * 2**30:
            return GPTConfig(vocab_size=32768, hidden=4096, layers=8, heads=32, seq_len=2048), 8
        return GPTConfig(vocab_size=32768, hidden=2048, layers=8, heads=16, seq_len=1024), 8
    return GPTConfig(hidden=512, layers=8, heads=8, seq_len=512), 8
