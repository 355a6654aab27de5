"""``--hf TYPE`` / ``--hf path/to/config.json``: a Hugging Face causal LM, built from a config.

Nothing is downloaded: TYPE is a transformers model type (``gpt2``, ``llama``, ``mistral``,
``qwen2``, ...) whose config class gives the architecture, resized to the built-in GPT's
size for this machine (hidden, layers, heads, sequence, vocabulary: ``--gpt`` / ``--seq``
override them); widths a family sets relative to the hidden size (the MLP's intermediate
size, key/value heads) keep the family's ratio. A config.json is used as written. Weights are
random (seeded), the batch is random token ids, and the loss is the model's own:
``model(input_ids=ids, labels=ids).loss``.

The parent resolves the argument once (:func:`resolve`: errors are usage errors then, not a
failure in every worker) into a :class:`HfModel` that travels in the run spec; each worker
builds the model from it (:func:`build`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HfModel", "resolve", "build", "SIZE_KEYS", "TOKEN_ID_KEYS"]

# --gpt keys that size a --hf TYPE model (GPTConfig name -> transformers' common name).
SIZE_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "vocab_size": "vocab_size"}
# Special token ids a family fixes for its own vocabulary (GPT-2's 50256).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class HfModel:
    """What a worker needs to build the model: ``AutoConfig.for_model(model_type, **config)``."""

    model_type: str
    config: dict[str, Any]
    seq_len: int
    label: str  # for the table's title

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "config": self.config, "seq_len": self.seq_len,
                "label": self.label}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("--hf needs transformers, which is not installed: pip install "
                         "'offload[hf]' (or pip install transformers)") from None
    return transformers


def _causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _scaled(defaults: Any, hidden: int, heads: int) -> dict[str, Any]:
    """Widths the family sets relative to hidden size / heads, at the new size."""
    out: dict[str, Any] = {}
    base_hidden = getattr(defaults, "hidden_size", None)
    inter = getattr(defaults, "intermediate_size", None)
    if isinstance(inter, int) and isinstance(base_hidden, int) and base_hidden:
        # Llama's 11008/4096 at hidden 512 is 1376: rounded to 64 like real checkpoints.
        out["intermediate_size"] = max(64, round(inter / base_hidden * hidden / 64) * 64)
    base_heads = getattr(defaults, "num_attention_heads", None)
    kv = getattr(defaults, "num_key_value_heads", None)
    if isinstance(kv, int) and isinstance(base_heads, int) and kv:
        group = max(1, base_heads // kv)  # query heads per key/value head (GQA)
        out["num_key_value_heads"] = heads // group if heads % group == 0 else heads
    if isinstance(getattr(defaults, "head_dim", None), int):
        out["head_dim"] = hidden // heads  # some configs fix it (Llama's 128)
    return out


def _token_ids(defaults: Any, vocab_size: int) -> dict[str, Any]:
    """Special token ids that fall outside the smaller vocabulary: its last id instead
    (transformers warns about, and an embedding's padding_idx would reject, the others)."""
    out = {}
    for key in TOKEN_ID_KEYS:
        value = getattr(defaults, key, None)
        if isinstance(value, int) and value >= vocab_size:
            out[key] = vocab_size - 1
    return out


def resolve(text: str, size: dict[str, int], seq_len: int | None) -> HfModel:
    """The model `--hf text` names.

    Args:
        text: a model type, or a path to a config.json (or to a directory holding one).
        size: GPTConfig fields sizing a TYPE (hidden, layers, heads, vocab_size, seq_len).
        seq_len: --seq, if given (else the sizing's, capped by a config.json's positions).

    Raises:
        ValueError: transformers is missing, the type is unknown or has no causal LM, the
            file is not a config.json, or the sizes do not fit the family.
    """
    transformers = _transformers()
    types = _causal_lm_types()
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if os.path.isfile(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--hf {text!r}: cannot read it as a config.json: {exc}") from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise ValueError(f"--hf {text!r}: a config.json needs a \"model_type\" (e.g. "
                             "\"llama\"); save one with config.save_pretrained(DIR)")
        model_type = config.pop("model_type")
        config.pop("transformers_version", None)
        config["use_cache"] = False  # training: no key/value cache
        where = os.path.abspath(path)  # "dir/file.json" names it in messages and the title
        source = os.path.join(os.path.basename(os.path.dirname(where)), os.path.basename(where))
    elif os.path.isdir(text):
        raise ValueError(f"--hf {text!r}: the directory has no config.json (save one there "
                         "with config.save_pretrained(DIR), or pass a model type such as gpt2)")
    elif os.sep in text or text.endswith(".json"):
        raise ValueError(f"--hf {text!r}: no such file (pass a model type such as gpt2, or a "
                         "path to a config.json)")
    else:
        model_type, config, source = text, None, None
    if model_type not in types:
        known = ", ".join(t for t in ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3")
                          if t in types)
        raise ValueError(f"--hf {text!r}: {model_type!r} is not a transformers model type with "
                         f"a causal LM (e.g. {known}; {len(types)} in this transformers "
                         f"{transformers.__version__})")
    if config is None:
        defaults = transformers.AutoConfig.for_model(model_type)
        hidden, heads = size["hidden"], size["heads"]
        config = {SIZE_KEYS[k]: size[k] for k in SIZE_KEYS}
        seq = seq_len or size["seq_len"]
        config["max_position_embeddings"] = max(seq, 1)
        config.update(_scaled(defaults, hidden, heads))
        config.update(_token_ids(defaults, config["vocab_size"]))
        config["use_cache"] = False
    try:
        built = transformers.AutoConfig.for_model(model_type, **config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--hf {text!r}: transformers refused the config: {exc}") from None
    if source is not None:
        positions = getattr(built, "max_position_embeddings", None)
        seq = seq_len or min(size["seq_len"], positions or size["seq_len"])
        if positions and seq > positions:
            raise ValueError(f"--seq {seq}: {source} allows max_position_embeddings="
                             f"{positions} (use --seq {positions} or less)")
    hidden = getattr(built, "hidden_size", None)
    heads = getattr(built, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads:
        raise ValueError(f"--hf {text!r}: hidden size {hidden} is not divisible by {heads} "
                         "attention heads (set --gpt hidden=...,heads=...)")
    label = (f"{types[model_type]} ({source or 'from ' + model_type + ' config'}) h{hidden} "
             f"L{getattr(built, 'num_hidden_layers', '?')} heads{heads} "
             f"vocab{getattr(built, 'vocab_size', '?')}")
    return HfModel(model_type=model_type, config=config, seq_len=seq, label=label)


def build(spec: dict[str, Any]):
    """The model of an :meth:`HfModel.to_dict` (on the current default device)."""
    transformers = _transformers()
    transformers.logging.set_verbosity_error()  # no "loss_type=None" advice per worker
    import torch

    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    # In float32 whatever the config's `torch_dtype` (the dtype its checkpoint was stored
    # in): --dtype says what the step runs in (bf16: autocast), and the row says --dtype;
    # a config of real weights in bfloat16 ran in bf16 while its row said fp32.
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)


