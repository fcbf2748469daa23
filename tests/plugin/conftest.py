"""Helpers for running the suite through pytester on small inline matrices."""

import pytest

TINY_MATRIX = """
name: tiny
envelope:
  max_num_seqs: 64
  max_num_batched_tokens: 2048
  max_model_len: 8192
  page_size: 16
  cuda_graph_sizes: [1, 8, 64]
  num_ubatches: 2
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096}
gpus: [L40S]
tp: [1, 2]
dcp: [1, 2]
mtp: [0]
gmu: [0.98]
"""


@pytest.fixture
def tiny_matrix(pytester):
    return pytester.makefile(".yaml", tiny=TINY_MATRIX)


@pytest.fixture
def suite_args(tiny_matrix):
    return ["--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(tiny_matrix), "-p", "no:cacheprovider"]
