"""The description of one worker run, sent from the parent to the worker as a JSON file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

__all__ = ["RunSpec"]


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to run one strategy, reproducibly.

    Every worker of one benchmark gets the same `seed`, `batch` and model, so the model
    initialisation, the batch and the dropout masks of every step are identical across
    strategies; only the strategy differs.
    """

    strategy: str
    device: str = "cpu"                       # "cpu", "cuda", "cuda:1"
    dtype: str = "fp32"                       # "fp32" | "bf16" (autocast)
    batch: int = 2
    warmup: int = 1
    steps: int = 3
    seed: int = 0
    gpt: dict | None = field(default=None)    # GPTConfig fields when the built-in GPT runs
    model: str | None = None                  # "module:factory" or "file.py:factory"
    hf: dict | None = None                    # --hf: offload.bench.hf.HfModel.to_dict()
    input_shape: tuple[int, ...] | None = None  # per-sample shape for --model
    input_vocab: int | None = None            # --model's inputs are token ids below this
    nvme_dir: str | None = None               # comma-separated, for the offload rows
    budget: str | None = None                 # passed to offload.activations(budget=) if set
    grads_path: str | None = None             # where to torch.save the checked gradients
    account: bool = True                      # run the (untimed) saved-bytes accounting pass
    explain: bool = False                     # return the auto plan as text
    plugins: tuple[str, ...] = ()             # --plugin modules the worker imports first

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        if data.get("input_shape") is not None:
            data["input_shape"] = tuple(data["input_shape"])
        data["plugins"] = tuple(data.get("plugins") or ())
        return cls(**data)

    def replace(self, **changes) -> "RunSpec":
        return dataclasses.replace(self, **changes)
