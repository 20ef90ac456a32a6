"""OpenVINO GenAI on CPU as a peer of the edge decode benchmark (``bench/edge_decode.py``).

:class:`OpenvinoGenaiRunner` offers the interface of that benchmark's runners (``single``,
``concurrent``, ``prefill_s``, ``close``, ``load_s``, ``kv_mb``, ``huge_pages_mb``) on an
``openvino_genai.LLMPipeline`` over the int4 OpenVINO IR that ``scripts/setup_openvino_genai.sh``
converts from the project's model (int4 sym weights for every matrix, OpenVINO tokenizer and
detokenizer beside it).

The runner works only inside ``.venv-ovgenai`` (the benchmark spawns its worker with that venv's
python) and imports nothing from the project: the caller passes the folder in, taking it from
:func:`model_folder` on the project's side. Prompts go in as token ids, so both engines see the
same prompt tokens; decoding is greedy with stop tokens ignored.

The pipeline is GenAI's default on CPU (paged attention under its continuous-batching
scheduler, whole prompts in one step) with one change: prefix caching off. GenAI turns it on by
default, and a repeated prompt would then skip its prefill (``prefill_s`` measures the same
prompt several times).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-ovgenai" / "bin" / "python"  # made by scripts/setup_openvino_genai.sh
MARKER = "edgecloud-peer.json"  # written last by the setup script: the folder is complete
FOLDER_FILES = (
    MARKER,
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_detokenizer.xml",
)


def model_folder(identity: str) -> Path:
    """Where the setup script puts the int4 IR of the model with ``identity``:
    ``<edgecloud home>/peers/openvino-genai/<identity>/int4``.

    For the orchestrating side, in the project's venv (the home is the project's own rule,
    ``routing.model_store.home_dir``); inside ``.venv-ovgenai`` the folder is passed in."""
    from routing.model_store import home_dir

    return home_dir() / "peers" / "openvino-genai" / identity / "int4"


def complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (the setup script writes MARKER last)."""
    return all((Path(folder) / f).is_file() for f in FOLDER_FILES)


def available() -> bool:
    """Whether OpenVINO GenAI can run: importable in this interpreter, or installed in
    ``.venv-ovgenai`` (where the benchmark runs this module's worker)."""
    if importlib.util.find_spec("openvino_genai") is not None:
        return True
    site = ROOT / ".venv-ovgenai" / "lib"
    return VENV_PYTHON.is_file() and any(site.glob("python3*/site-packages/openvino_genai"))


class OpenvinoGenaiRunner:
    """``openvino_genai.LLMPipeline`` on CPU with ``threads`` inference threads, greedy."""

    def __init__(self, folder: Path, threads: int) -> None:
        import openvino as ov
        import openvino_genai as ovg

        self.ov, self.ovg = ov, ovg
        t0 = time.perf_counter()
        scheduler = ovg.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # GenAI's default on, see the module docstring
        scheduler.max_num_batched_tokens = 2**64 - 1  # as GenAI's default: prompts in one step
        config: dict[str, Any] = {
            "INFERENCE_NUM_THREADS": threads,
            "scheduler_config": scheduler,
        }
        self.pipe = ovg.LLMPipeline(str(folder), "CPU", **config)
        self.load_s = time.perf_counter() - t0
        self.kv_mb = 0.0  # paged KV blocks, allocated by GenAI as requests grow
        self.huge_pages_mb = 0.0

    def _config(self, new: int) -> Any:
        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens = new
        cfg.min_new_tokens = new
        cfg.ignore_eos = True
        cfg.do_sample = False
        cfg.apply_chat_template = False  # the ids are already chat-templated
        return cfg

    def _inputs(self, rows: list[list[int]]) -> Any:
        import numpy as np

        ids = np.array(rows, dtype=np.int64)
        return self.ovg.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(np.ones_like(ids)))

    def _stamped(self, ids: list[int], new: int) -> tuple[list[int], list[float], float]:
        """One request: its tokens, a perf_counter stamp per streamed token, and the start."""
        stamps: list[float] = []
        running = self.ovg.StreamingStatus.RUNNING

        class Stamper(self.ovg.StreamerBase):  # type: ignore[name-defined,misc]
            def write(self, token: int | list[int]) -> Any:
                now = time.perf_counter()
                stamps.extend([now] * (1 if isinstance(token, int) else len(token)))
                return running

            def end(self) -> None:
                pass

        t0 = time.perf_counter()
        result = self.pipe.generate(self._inputs([ids]), self._config(new), Stamper())
        return [int(t) for t in result.tokens[0]], stamps, t0

    def single(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        """Decode tokens/s after the first token (streamer stamps), and the tokens."""
        tokens, stamps, _ = self._stamped(ids, new)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens

    def concurrent(self, ids: list[int], new: int, streams: int = 4) -> float:
        """Steady state of ``streams`` requests of the prompt at once: tokens after every stream
        has its first, over that time.

        GenAI runs a batch given to ``generate`` as that many requests of its continuous-batching
        scheduler, all decoding in every step (a streamer is refused for a batch). Its raw perf
        metrics keep, per scheduler step, the tokens it made (``m_batch_sizes``) and when
        (``m_new_token_times``, ms): every stream has its first token by the first step that
        made ``streams`` tokens (each stream makes at most one per step)."""
        result = self.pipe.generate(self._inputs([ids] * streams), self._config(new))
        raw = result.perf_metrics.raw_metrics
        sizes = [int(n) for n in raw.m_batch_sizes]
        times_ms = [float(t) for t in raw.m_new_token_times]
        first = next((k for k, n in enumerate(sizes) if n == streams), None)
        if first is None or first == len(sizes) - 1:
            raise RuntimeError(f"no steady state in GenAI's steps: tokens per step {sizes}")
        return sum(sizes[first + 1 :]) / ((times_ms[-1] - times_ms[first]) / 1e3)

    def prefill_s(self, ids: list[int]) -> float:
        """Time to first token of one prompt (prefix caching off: always a full prefill)."""
        _, stamps, t0 = self._stamped(ids, 1)
        return stamps[0] - t0

    def close(self) -> None:
        del self.pipe
