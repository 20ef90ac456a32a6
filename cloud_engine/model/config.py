"""Model configuration read from a Hugging Face ``config.json`` (Llama family)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style bias on q/k/v projections
    qk_norm: bool = False  # Qwen3-style RMSNorm on q and k per head
    model_type: str = "llama"
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mtype = d.get("model_type", "llama")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {mtype!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_t = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        rope_params = d.get("rope_parameters") or {}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=d.get("rope_scaling")
            or ({k: v for k, v in rope_params.items() if k != "rope_theta"} or None),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", mtype == "qwen2")),
            qk_norm=mtype == "qwen3",
            model_type=mtype,
            eos_token_id=eos_t,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers reads as the same architecture (used by tests)."""
        arch = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
        }[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
        if self.eos_token_id:
            d["eos_token_id"] = list(self.eos_token_id)
        return d
