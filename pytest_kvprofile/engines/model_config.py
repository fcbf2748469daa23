"""A case's head layout as a Hugging Face ``config.json`` on disk, which an engine's own config pipeline reads.

Why engine-free: vLLM and SGLang both build their model config from a local directory, never a download; the
decoder's keys and the atomic, content-addressed write are the same for both, only the architecture (which each
engine branches on) and a few engine-specific keys differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_kvprofile.matrix.cases import Case

__all__ = ["config_dir", "decoder_config"]


def decoder_config(case: Case, architecture: str, model_type: str, **extra: object) -> dict[str, object]:
    """The ``config.json`` of a plain decoder with the case's head layout under ``architecture``, plus ``extra``."""
    model = case.model
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": model.hidden,
        "intermediate_size": 4 * model.hidden,
        "num_attention_heads": model.heads_q,
        "num_key_value_heads": model.heads_kv,
        "head_dim": model.head_dim,
        "num_hidden_layers": model.num_layers,
        "vocab_size": 32000,
        "max_position_embeddings": max(case.envelope.max_model_len, 4096),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": model.kv.model_torch,
        "tie_word_embeddings": False,
        **extra,
    }


def config_dir(config: dict[str, object], root: Path) -> Path:
    """A directory under ``root`` holding ``config`` as ``config.json``, named by its content: written once per
    layout, atomically (a concurrent worker writing the same file replaces it with the same bytes)."""
    text = json.dumps(config, sort_keys=True, indent=1)
    folder = root / hashlib.sha256(text.encode()).hexdigest()[:16]
    path = folder / "config.json"
    if not path.exists() or path.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return folder
