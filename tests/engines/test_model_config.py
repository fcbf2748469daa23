"""``engines/model_config.py``: one decoder ``config.json`` per layout, shared by the engine adapters."""

from __future__ import annotations

import json

from pytest_kvprofile.engines.model_config import config_dir, decoder_config
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASES = [c for c in load_matrix(packaged_matrix("ci")).cases if c.model.attention != "mla"]


def test_a_layout_is_written_once_and_named_by_its_content(tmp_path):
    first, other = CASES[0], next(c for c in CASES if c.model.heads_kv != CASES[0].model.heads_kv)
    config = decoder_config(first, "LlamaForCausalLM", "llama", pad_token_id=None)
    folder = config_dir(config, tmp_path)
    assert json.loads((folder / "config.json").read_text()) == config and config["pad_token_id"] is None
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert config_dir(dict(config), tmp_path) == folder and (folder / "config.json").stat().st_mtime_ns == stamp
    assert config_dir(decoder_config(other, "LlamaForCausalLM", "llama"), tmp_path) != folder
    assert decoder_config(first, "Qwen3ForCausalLM", "qwen3")["num_key_value_heads"] == first.model.heads_kv
