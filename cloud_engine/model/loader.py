"""Loading a model folder (HF safetensors) into :class:`LlamaForCausalLM`, and writing tiny
random models for parity tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cloud_engine.model.config import ModelConfig
from cloud_engine.model.llama import LlamaForCausalLM


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and load every ``*.safetensors`` shard strictly.

    Invariant: every parameter is loaded from the files (a tied head is the embedding itself);
    a missing or unexpected tensor is an error, never a silently random weight.
    """
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for shard in shards:
        state.update(load_file(str(shard), device="cpu"))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = expected - state.keys(), state.keys() - expected
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"weights do not match config: missing={sorted(missing)[:5]} unexpected={sorted(unexpected)[:5]}"
        )
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = type(model.rotary)(
        cfg
    )  # re-create the non-persistent buffer off the meta device
    return model.to(device).eval()


def tiny_config(**overrides: object) -> ModelConfig:
    """A small Llama config for parity tests (GQA on, untied head by default)."""
    base: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def init_random_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Fill ``model`` in place with random weights scaled so logits are well spread (greedy ties
    are vanishingly rare); uses the global torch RNG, so seed it first."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / (p.shape[1] ** 0.5))
            else:
                p.normal_(0.0, 0.02)
    return model


def save_random_model(
    folder: str | Path, cfg: ModelConfig, seed: int = 0, tokenizer_from: str | Path | None = None
) -> Path:
    """Write a random-weight model in HF layout. Weights are scaled so logits are well spread
    (greedy ties are vanishingly rare). ``tokenizer_from`` copies a real model's tokenizer files
    (its vocab must fit ``cfg.vocab_size``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = init_random_weights(LlamaForCausalLM(cfg))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            src = Path(tokenizer_from) / f
            if src.is_file():
                shutil.copy(src, folder / f)
    return folder
