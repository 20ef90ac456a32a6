"""The random-weight models ``bench/morning_peak_live.py`` serves, written where it runs (no
model store there): both folders are named :data:`MODEL_NAME`, so the gateway sees one model
served by both tiers.

- edge: the default model's shape (SmolLM2-135M, ``bench/random_default_shape.py``), with the
  default model's tokenizer files (``--tokenizer-dir``);
- cloud: Llama-3.1-8B's shape (``bench/cloud_throughput.SHAPES``), bf16, its tensors drawn on
  the GPU; its tokenizer is the default one with placeholder tokens ``<xN>`` up to the 8B's
  128,256-entry vocabulary (a sampled id must decode to text: the client times its first token
  by the first text it streams);
- ``--smoke``: one tiny model (2 layers, 64 wide) for both tiers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MODEL_NAME = "peak-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)


def tiny_model(root: Path, tokenizer_dir: Path) -> Path:
    """A tiny random model of the default tokenizer's vocabulary (smoke runs)."""
    from cloud_engine.model.loader import save_random_model, tiny_config

    cfg = tiny_config(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    return save_random_model(root / "tiny" / MODEL_NAME, cfg, tokenizer_from=tokenizer_dir)


def edge_model(root: Path, tokenizer_dir: Path) -> Path:
    """Random weights of the default model's shape."""
    from bench.random_default_shape import default_shape_config
    from cloud_engine.model.loader import save_random_model

    folder = root / "edge" / MODEL_NAME
    return save_random_model(folder, default_shape_config(), tokenizer_from=tokenizer_dir)


def widen_tokenizer(src: Path, dst: Path, vocab_size: int) -> None:
    """Copy the tokenizer files from ``src`` to ``dst``, the vocabulary grown to ``vocab_size``
    with placeholder tokens ``<xN>`` (plain ASCII: byte-level decoding gives them as text)."""
    _copy_tokenizer(src, dst)
    data = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for i in range(max(taken) + 1, vocab_size):
        vocab[f"<x{i}>"] = i
    (dst / "tokenizer.json").write_text(json.dumps(data))


def cloud_model(root: Path, tokenizer_dir: Path, shape: str = "llama-3.1-8b") -> Path:
    """Random bf16 weights of ``shape`` (a key of ``bench.cloud_throughput.SHAPES``), drawn on
    the GPU tensor by tensor (the 8B's 16 GB in about a minute, written once per host)."""
    import torch
    from safetensors.torch import save_file

    from bench.cloud_throughput import SHAPES
    from cloud_engine.model.config import ModelConfig
    from cloud_engine.model.llama import LlamaForCausalLM

    folder = root / shape / MODEL_NAME
    if (folder / "model.safetensors").is_file():
        return folder  # a warm host keeps it between calls
    folder.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(dict(SHAPES[shape]))
    with torch.device("meta"):
        names = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for name, shp in names.items():
        t = torch.empty(shp, device="cuda", dtype=torch.float32)
        if name.endswith("norm.weight"):
            t.uniform_(0.8, 1.2, generator=gen)
        elif len(shp) == 2:
            t.normal_(0.0, 1.0 / shp[1] ** 0.5, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        state[name] = t.to(torch.bfloat16).cpu()
    tmp = folder / "model.safetensors.part"
    save_file(state, str(tmp), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    widen_tokenizer(tokenizer_dir, folder, cfg.vocab_size)
    tmp.rename(folder / "model.safetensors")
    return folder
