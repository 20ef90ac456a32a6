"""Write and check an imported Hugging Face Llama folder: ``import_gguf`` writes config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and generation_config.json for a parsed
GGUF (not the manifest), and ``verify_folder`` re-reads such a folder: tensor names and shapes
must match config.json, and the tokenizer must load with each special token one id. No torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cloud_engine.model.catalog import write_json
from cloud_engine.model.gguf_convert import (
    build_tokenizer,
    convert_tensors,
    hf_config,
    tokenizer_files,
)
from cloud_engine.model.gguf_source import PullError

WEIGHTS_FILE = "model.safetensors"


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def import_gguf(reader, out_dir: Path, *, progress: bool = True) -> dict:
    """Write an HF Llama folder for the parsed GGUF into ``out_dir`` (which exists); return the
    config. Does not write the manifest."""
    from safetensors.numpy import save_file

    cfg = hf_config(reader)
    tensors = convert_tensors(reader, cfg, progress=progress)
    expected = _expected_shapes(cfg)
    if "lm_head.weight" in tensors and cfg["tie_word_embeddings"]:
        raise PullError("internal: lm_head present but config says tied")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise PullError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    del tensors
    write_json(out_dir / "config.json", cfg)
    # safetensors creates its file owner-only; give it the mode the umask gives other files.
    os.chmod(out_dir / WEIGHTS_FILE, (out_dir / "config.json").stat().st_mode & 0o777)
    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    tc, gc = tokenizer_files(reader, cfg)
    write_json(out_dir / "tokenizer_config.json", tc)
    write_json(out_dir / "generation_config.json", gc)
    return cfg


def verify_folder(folder: Path) -> None:
    """Re-read an imported folder: tensor names and shapes match config.json, the tokenizer
    loads and its special tokens encode to single ids. PullError otherwise."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    try:
        cfg = json.loads((folder / "config.json").read_text())
        expected = _expected_shapes(cfg)
        with safe_open(str(folder / WEIGHTS_FILE), framework="numpy") as f:
            keys = set(f.keys())
            if keys != set(expected):
                extra, lack = sorted(keys - set(expected)), sorted(set(expected) - keys)
                raise PullError(
                    f"weights do not match config: extra {extra[:3]}, missing {lack[:3]}"
                )
            for k in keys:
                shape = tuple(f.get_slice(k).get_shape())
                if shape != expected[k]:
                    raise PullError(f"{k} has shape {shape}, config implies {expected[k]}")
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        if tok.get_vocab_size(with_added_tokens=True) != cfg["vocab_size"]:
            raise PullError(
                f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                f"config says {cfg['vocab_size']}"
            )
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        for entry in tc.get("added_tokens_decoder", {}).values():
            ids = tok.encode(entry["content"], add_special_tokens=False).ids
            if len(ids) != 1:
                raise PullError(f"special token {entry['content']!r} encodes to {ids}")
        json.loads((folder / "generation_config.json").read_text())
    except PullError:
        raise
    except Exception as e:
        raise PullError(
            f"verification of the imported folder failed: {type(e).__name__}: {e}"
        ) from e
