"""Write a random-weight model of the default model's shape (SmolLM2-135M: 30 layers, 576
hidden, 9 heads, 3 KV heads, 49152 vocabulary, tied head) for machines without the store.

    python bench/random_default_shape.py OUT [TOKENIZER_DIR]

``TOKENIZER_DIR`` (the default model's tokenizer files) makes the folder servable by a node.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cloud_engine.model.config import ModelConfig  # noqa: E402
from cloud_engine.model.loader import save_random_model, tiny_config  # noqa: E402


def default_shape_config() -> ModelConfig:
    """The default model's shape (SmolLM2-135M)."""
    return tiny_config(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    )


if __name__ == "__main__":
    tokenizer = sys.argv[2] if len(sys.argv) > 2 else None
    print(save_random_model(sys.argv[1], default_shape_config(), seed=0, tokenizer_from=tokenizer))
