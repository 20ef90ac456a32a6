"""Tiny mixture-of-experts checkpoints written by transformers' own classes (Qwen3-MoE, also in
the packed expert layout, Qwen2-MoE with its shared expert, Mixtral), for the MoE tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


# Qwen3-MoE: 4 experts, top-2, renormalised
QWEN3_MOE = dict(
    COMMON,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def _spread(model: torch.nn.Module) -> None:
    """Weights scaled so logits are well spread (HF's 0.02 init leaves near-ties)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / (p.shape[-1] ** 0.5))
            else:
                p.normal_(0.0, 0.02)


def _write(folder: Path, config, cls, packed: bool = False) -> Path:  # type: ignore[no-untyped-def]
    """``save_pretrained`` writes the per-expert layout; ``packed`` writes the in-memory state
    dict as is (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])."""
    torch.manual_seed(11)
    model = cls(config).eval()
    _spread(model)
    model.save_pretrained(folder)
    if packed:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        for f in folder.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_moe_models(root: Path) -> dict[str, Path]:
    """Every MoE family under ``root``, by name."""
    import transformers as tf

    return {
        "qwen3_moe": _write(
            root / "qwen3moe",
            tf.Qwen3MoeConfig(
                **QWEN3_MOE,
                mlp_only_layers=[1],
            ),
            tf.Qwen3MoeForCausalLM,
        ),
        "qwen3_moe_packed": _write(
            root / "qwen3moe-packed",
            tf.Qwen3MoeConfig(
                **QWEN3_MOE,
            ),
            tf.Qwen3MoeForCausalLM,
            packed=True,
        ),
        "qwen2_moe": _write(
            root / "qwen2moe",
            tf.Qwen2MoeConfig(
                **COMMON,
                intermediate_size=96,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
            ),
            tf.Qwen2MoeForCausalLM,
        ),
        "mixtral": _write(
            root / "mixtral",
            tf.MixtralConfig(
                **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
            ),
            tf.MixtralForCausalLM,
        ),
    }
