"""Turn a parsed GGUF (``gguf.GGUFReader``) into Hugging Face Llama parts: config.json from its
metadata, float32 tensors under their HF names, and the byte-level BPE tokenizer with its
tokenizer_config.json and generation_config.json contents. Only the ``llama`` architecture and
the ``gpt2`` tokenizer model are accepted (PullError otherwise). Weights come out in HF order:
llama.cpp's row permutation of q_proj/k_proj (made for its adjacent-pair RoPE) is undone, so
the rotate-half RoPE of HF Llama applies. Needs numpy, ``gguf`` and ``tokenizers``; no torch.
"""

from __future__ import annotations

import re
import sys
import time

import numpy as np

from cloud_engine.model.gguf_source import PullError

TOKEN_TYPE_CONTROL = 3


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _require(reader, key: str):
    v = _field(reader, key)
    if v is None:
        raise PullError(f"GGUF metadata lacks {key!r}")
    return v


def hf_config(reader) -> dict:
    """config.json for LlamaForCausalLM, every field from the GGUF's metadata."""
    arch = _require(reader, "general.architecture")
    if arch != "llama":
        raise PullError(f"unsupported GGUF architecture {arch!r}: only 'llama' is imported")
    a = f"{arch}."
    hidden = int(_require(reader, a + "embedding_length"))
    n_head = int(_require(reader, a + "attention.head_count"))
    n_kv = int(_field(reader, a + "attention.head_count_kv", n_head))
    head_dim = int(_field(reader, a + "attention.key_length", 0) or hidden // n_head)
    tokens = _require(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, a + "vocab_size", 0) or len(tokens))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_require(reader, a + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_require(reader, a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_require(reader, a + "context_length")),
        "vocab_size": vocab,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    if pad is not None:
        cfg["pad_token_id"] = int(pad)
    # Rounded float32 -> float64 noise (9.99999974e-06): keep the value llama.cpp was given.
    cfg["rms_norm_eps"] = float(np.format_float_positional(np.float32(cfg["rms_norm_eps"])))
    return cfg


_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF Llama name of a llama.cpp tensor name, or None for tensors HF does not keep
    (e.g. precomputed ``rope_freqs``)."""
    if gguf_name in _TOP_MAP:
        return _TOP_MAP[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's converter permutation of q/k rows.

    llama.cpp stores ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)``
    (d = rows per head), interleaving the two rotate-half halves of each head into adjacent
    pairs; this puts the halves back."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise PullError(f"cannot unpermute a tensor of {rows} rows over {n_head} heads")
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


class _Counter:
    """A compact progress line on stderr: rewritten in place on a terminal, else a few lines."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.next_pct = 25

    def step(self, i: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            print(f"\r{self.label} {i}/{self.total}", end="", file=sys.stderr, flush=True)
        elif i * 100 >= self.next_pct * self.total and i < self.total:
            print(f"{self.label} {i}/{self.total}", file=sys.stderr, flush=True)
            self.next_pct += 25

    def done(self) -> None:
        if self.enabled:
            dt = time.monotonic() - self.t0
            end = "\r" if self.tty else ""
            print(
                f"{end}{self.label} {self.total}/{self.total} ({dt:.1f} s)",
                file=sys.stderr,
                flush=True,
            )


def convert_tensors(reader, cfg: dict, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, rotary permutation undone."""
    from gguf.quants import dequantize

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    counter = _Counter("dequantizing tensors", len(reader.tensors), progress)
    for i, t in enumerate(reader.tensors, 1):
        name = hf_name(t.name)
        if name is None:
            counter.step(i)
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise PullError(f"tensor {t.name}: cannot dequantize {t.tensor_type.name}: {e}") from e
        w = np.asarray(w, dtype=np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary(w, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary(w, n_kv)
        out[name] = np.ascontiguousarray(w)
        counter.step(i)
    counter.done()
    return out


def build_tokenizer(reader):
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF's tokens and merges, with the
    control tokens registered as special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise PullError(f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE (gpt2)")
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise PullError("GGUF tokenizer has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [tokens[i] for i, ty in enumerate(types) if int(ty) == TOKEN_TYPE_CONTROL]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, single_word=False) for t in control]
    )
    return tok


def tokenizer_files(reader, cfg: dict) -> tuple[dict, dict]:
    """(tokenizer_config.json, generation_config.json) contents."""
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))

    def tok_at(key: str) -> str | None:
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    added = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, ty in enumerate(types)
        if int(ty) == TOKEN_TYPE_CONTROL
    }
    tc: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "added_tokens_decoder": added,
        "bos_token": tok_at("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_at("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_at("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_at("tokenizer.ggml.unknown_token_id"),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tc["chat_template"] = template
    tc = {k: v for k, v in tc.items() if v is not None}

    eos_ids: list[int] = []
    if "eos_token_id" in cfg:
        eos_ids.append(cfg["eos_token_id"])
    if "<|endoftext|>" in tokens:
        eot = tokens.index("<|endoftext|>")
        if eot not in eos_ids:
            eos_ids.append(eot)
    gc: dict = {"eos_token_id": eos_ids}
    if "bos_token_id" in cfg:
        gc["bos_token_id"] = cfg["bos_token_id"]
    if "pad_token_id" in cfg:
        gc["pad_token_id"] = cfg["pad_token_id"]
    return tc, gc
