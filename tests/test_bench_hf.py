"""offload-bench --hf: a Hugging Face causal LM built from transformers' config for a model
type (no download), sized like the built-in GPT, or from a config.json; every strategy
bit-exact against `none` (the bench's per-step gradient CRCs and the last step's tensors).
"""
from __future__ import annotations

import json

import pytest

from offload.bench import rows as rows_mod
from offload.bench.cli import main

transformers = pytest.importorskip("transformers", reason="--hf needs transformers")

TINY = ["--gpt", "hidden=64,layers=2,heads=4,vocab_size=128", "--seq", "32", "--batch", "2",
        "--warmup", "1", "--steps", "2"]


def _rows(path) -> dict[str, rows_mod.Row]:
    return {r.strategy: r for r in rows_mod.from_json(path.read_text())}


def test_gpt2_every_checkpointing_and_offload_row_bit_exact(tmp_path, nvme_dir, monkeypatch,
                                                            capsys):
    monkeypatch.setenv("OFFLOAD_MIN_BYTES", "0")  # tiny tensors would stay put otherwise
    out = tmp_path / "rows.json"
    code = main(["--hf", "gpt2", *TINY, "--nvme-dir", nvme_dir, "--json", str(out),
                 "--strategies", "none,checkpoint,recompute,ckpt+save_on_cpu,offload-nvme"])
    assert code == 0
    rows = _rows(out)
    assert list(rows) == ["none", "checkpoint", "recompute", "ckpt+save_on_cpu", "offload-nvme"]
    for name, row in rows.items():
        assert row.available, (name, row.reason)
        assert row.model.startswith("GPT2LMHeadModel (from gpt2 config) h64 L2 heads4 vocab128")
        assert row.tokens_per_step == 2 * 32 and row.seq_len == 32
        assert row.blocks == ["transformer.h.0", "transformer.h.1"]
        if name != "none":
            assert row.bit_exact is True and row.grads_differ_steps == [], (name, row.grads_differ)
    assert rows["offload-nvme"].nvme_bytes > 0 and rows["recompute"].nvme_bytes > 0
    assert rows["checkpoint"].resident_bytes < rows["none"].resident_bytes
    assert "GPT2LMHeadModel (from gpt2 config)" in capsys.readouterr().out


def test_config_json_as_written(tmp_path, nvme_dir, monkeypatch):
    # A Mistral config.json (GQA, sliding window, rotary): used as written, no resizing.
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=24)
    cfg.save_pretrained(tmp_path / "mistral")
    monkeypatch.setenv("OFFLOAD_MIN_BYTES", "0")
    out = tmp_path / "rows.json"
    code = main(["--hf", str(tmp_path / "mistral" / "config.json"), "--batch", "2",
                 "--warmup", "1", "--steps", "1", "--strategies", "recompute",
                 "--nvme-dir", nvme_dir, "--json", str(out)])
    assert code == 0
    rows = _rows(out)
    assert rows["none"].model.startswith("MistralForCausalLM (mistral/config.json) h64 L2 "
                                         "heads4 vocab96")
    assert rows["none"].seq_len == 24  # the config's positions cap the default 512
    assert rows["recompute"].bit_exact is True, rows["recompute"].reason


def test_type_is_sized_for_the_machine_in_the_familys_proportions():
    from offload.bench import hf
    from offload.bench.models import gpt_for_machine

    size = dict(vars(gpt_for_machine("cpu")[0]))
    llama = hf.resolve("llama", size, None)
    assert llama.seq_len == size["seq_len"] == 512
    c = llama.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["vocab_size"]) == (512, 8, 8, 1024)
    assert c["intermediate_size"] == 1408       # Llama's 11008/4096 of 512, to a multiple of 64
    assert c["head_dim"] == 64 and c["use_cache"] is False
    mistral = hf.resolve("mistral", size, 128).config
    assert mistral["num_key_value_heads"] == 2  # 4 query heads per key/value head, as Mistral
    assert hf.resolve("mistral", size, 128).seq_len == 128
    gpt2 = transformers.AutoConfig.for_model("gpt2", **hf.resolve("gpt2", size, None).config)
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions) == (512, 8, 8, 512)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_a_config_of_bfloat16_weights_builds_the_model_the_row_says(key, tmp_path):
    """A real checkpoint's config.json carries the dtype its weights were stored in: the
    model was built in bfloat16 and ran so, while its row said fp32 (--dtype)."""
    import torch
    from offload.bench import hf

    (tmp_path / "llama.json").write_text(json.dumps({
        "model_type": "llama", key: "bfloat16", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}))
    model = hf.build(hf.resolve(str(tmp_path / "llama.json"), {"seq_len": 8}, None).to_dict())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_config_json_errors(tmp_path):
    from offload.bench import hf

    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="a config.json needs a \"model_type\""):
        hf.resolve(str(tmp_path / "bad.json"), {"seq_len": 8}, None)
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama",
                                                     "max_position_embeddings": 16}))
    with pytest.raises(ValueError, match=r"--seq 32: [\w-]+/llama.json allows "
                                         "max_position_embeddings=16"):
        hf.resolve(str(tmp_path / "llama.json"), {"seq_len": 512}, 32)
    assert hf.resolve(str(tmp_path / "llama.json"), {"seq_len": 512}, None).seq_len == 16
    (tmp_path / "vit.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="'vit' is not a transformers model type with a causal"):
        hf.resolve(str(tmp_path / "vit.json"), {"seq_len": 8}, None)
