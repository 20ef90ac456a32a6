"""--pp-layers: even, explicit counts, and the split balanced against the LM head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_engine.parallel.dist import (
    ParallelConfig,
    balanced_layers,
    layer_weights,
    parse_pp_layers,
)

# SmolLM2-135M's shape: 30 layers of 3.54M weights; a tied 49152 x 576 LM head (28.3M, 8 layers)
SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)  # fmt: skip


def test_layer_weights_count_attention_mlp_and_active_experts():
    layer, head = layer_weights(SMOLLM2)
    assert layer == 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536
    assert head == 576 * 49152
    moe = dict(SMOLLM2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
               shared_expert_intermediate_size=512)  # fmt: skip
    assert layer_weights(moe)[0] == 576 * 64 * 24 + 2 * 3 * 576 * 256 + 3 * 576 * 512


def test_balanced_split_gives_the_last_stage_fewer_layers():
    assert balanced_layers(SMOLLM2, 1) == (30,)
    counts = balanced_layers(SMOLLM2, 2)
    assert counts == (19, 11) and sum(counts) == 30
    layer, head = layer_weights(SMOLLM2)
    even = max(15 * layer, 15 * layer + head)
    assert max(19 * layer, 11 * layer + head) < 0.85 * even  # the heaviest stage: 17% lighter
    four = balanced_layers(SMOLLM2, 4)
    assert sum(four) == 30 and len(four) == 4 and four[-1] < min(four[:-1])
    # a model whose head is negligible splits evenly
    big = dict(SMOLLM2, intermediate_size=100_000, vocab_size=16)
    assert balanced_layers(big, 2) == (15, 15)
    assert ParallelConfig(1, 2, counts).stage_layers(30) == [range(0, 19), range(19, 30)]


def test_parse_pp_layers(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert parse_pp_layers(None, tmp_path, 2) is None
    assert parse_pp_layers("10,20", tmp_path, 2) == (10, 20)
    assert parse_pp_layers("balanced", tmp_path, 2) == (19, 11)
    with pytest.raises(ValueError, match="--pp-layers 'ten,20'"):
        parse_pp_layers("ten,20", tmp_path, 2)
    with pytest.raises(ValueError, match="cannot make"):
        balanced_layers(dict(SMOLLM2, num_hidden_layers=1), 2)
