"""The edge's quality gate: which exported variant this CPU serves by default.

Each variant (``fp32``, ``int8``, ``int4``) is measured on this CPU with the sets shipped in
``data/quality_set.json``:

- ``nll``: the mean negative log-likelihood per token of the reference answers after their
  chat prompt (teacher-forced);
- ``correct``: the plain questions whose greedy answer contains an accepted answer (as a word);
- ``invariant``: the greedy answers are token for token the same whether the prompt is prefilled
  whole or in 16-token chunks (what prefix reuse and chunked prefill do) and whether the answer
  decodes alone or beside another in one batch;
- ``decode_ms``: a single-stream decode step.

The default is the fastest variant that is invariant, has ``nll`` within ``NLL_TOLERANCE`` of
fp32's and answers at least as many questions as fp32 less one; else fp32. A variant no faster
than fp32 is not evaluated. The result is written beside the model's exports
(``quality_gate.json``) and reused while the CPU, the quality set and the graphs are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.export import VARIANTS, ExportedGraph, ensure_export, onnx_root
from routing.blocks import BLOCK_SIZE
from routing.model_store import ModelInfo, resolve
from routing.progress import step

log = logging.getLogger(__name__)

GATE_FILE = "quality_gate.json"
NLL_TOLERANCE = 0.03  # a variant's mean NLL may exceed fp32's by at most this fraction
QUESTION_SLACK = 1  # ... and answer at most this many fewer plain questions
ANSWER_TOKENS = 32  # greedy tokens generated per plain question (a whole sentence)
CHUNK = BLOCK_SIZE  # the chunk size of the invariance check (one prefix-cache block)
INVARIANCE_QUESTIONS = 8  # the plain questions the invariance check decodes again
SPEED_STEPS = 16  # decode steps timed per variant


@dataclass(frozen=True)
class QualitySet:
    """Reference answers (prompt, answer) and plain questions (prompt, accepted answers)."""

    references: tuple[tuple[str, str], ...]
    questions: tuple[tuple[str, tuple[str, ...]], ...]
    digest: str  # of the file's bytes: a changed set means a new gate run

    @classmethod
    def shipped(cls) -> QualitySet:
        raw = resources.files("edge_runtime").joinpath("data/quality_set.json").read_bytes()
        data = json.loads(raw)
        return cls(
            references=tuple((r["prompt"], r["answer"]) for r in data["references"]),
            questions=tuple((q["prompt"], tuple(q["accept"])) for q in data["questions"]),
            digest=hashlib.sha256(raw).hexdigest()[:16],
        )


def answers_right(text: str, accept: Sequence[str]) -> bool:
    """Whether ``text`` contains one of ``accept`` as a whole word (case-insensitive)."""
    low = text.lower()
    return any(re.search(rf"\b{re.escape(a.lower())}\b", low) for a in accept)


@dataclass(frozen=True)
class VariantScore:
    """One variant measured on this CPU; ``why`` is empty when it passed the gate."""

    variant: str
    decode_ms: float
    nll: float | None = None  # None: not evaluated (no faster than fp32)
    correct: int = 0
    total: int = 0
    invariant: bool = False
    why: str = ""

    @property
    def passed(self) -> bool:
        return self.nll is not None and not self.why


@dataclass(frozen=True)
class GateResult:
    """The gate's verdict for one model on one CPU."""

    chosen: str
    cpu: str
    set_digest: str
    graphs: dict[str, float]  # variant -> its export's creation time
    scores: tuple[VariantScore, ...]
    created_unix: float = field(default_factory=time.time)

    def score(self, variant: str) -> VariantScore | None:
        return next((s for s in self.scores if s.variant == variant), None)

    def summary(self) -> str:
        """One line: the chosen variant and how it and fp32 scored."""
        chosen, base = self.score(self.chosen), self.score("fp32")
        if chosen is None or base is None or base.nll is None:
            return self.chosen
        if self.chosen == "fp32":
            rejected = [f"{s.variant}: {s.why}" for s in self.scores if s.variant != "fp32"]
            return "fp32 (" + "; ".join(rejected) + ")" if rejected else "fp32"
        assert chosen.nll is not None
        return (
            f"{self.chosen} (NLL {100 * (chosen.nll / base.nll - 1):+.1f}% of fp32, "
            f"{chosen.correct}/{chosen.total} questions against fp32's {base.correct}, "
            f"{chosen.decode_ms:.1f} ms a token against {base.decode_ms:.1f})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> GateResult:
        data: dict[str, Any] = json.loads(text)
        data["scores"] = tuple(VariantScore(**s) for s in data["scores"])
        return cls(**data)


def cpu_signature() -> str:
    """This CPU's model name and the instruction sets ONNX Runtime picks kernels by."""
    name, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name == platform.machine():
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("avx", "amx", "asimd", "sve", "i8mm")))
    return f"{name} [{' '.join(isa)}]"


def gate_path(info: ModelInfo, root: Path | None = None) -> Path:
    return (root or onnx_root()) / info.identity / GATE_FILE


def read_gate(info: ModelInfo, root: Path | None = None) -> GateResult | None:
    """The gate's cached verdict for ``info`` on this CPU (None: none, or another CPU's)."""
    path = gate_path(info, root)
    try:
        result = GateResult.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return result if result.cpu == cpu_signature() else None


def choose_variant(
    model: str | Path, *, root: Path | None = None, threads: int | None = None
) -> GateResult:
    """The gate's verdict for ``model`` on this CPU: cached, or measured now (exporting the
    variants first if needed; a few minutes for the default model). Concurrent callers
    serialize on a file lock; the verdict file appears only complete."""
    from filelock import FileLock

    info = resolve(model)
    graphs = {v: ensure_export(model, v, root=root) for v in VARIANTS}
    created = {v: g.meta.created_unix for v, g in graphs.items()}
    qset = QualitySet.shipped()
    path = gate_path(info, root)
    with FileLock(str(path) + ".lock"):
        cached = read_gate(info, root)
        if cached is not None and cached.set_digest == qset.digest and cached.graphs == created:
            return cached
        with step(f"checking {info.name}'s edge variants on this CPU (quality gate)"):
            result = run_gate(graphs, qset, threads)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(result.to_json())
        tmp.replace(path)
    log.info("quality gate for %s: %s", info.name, result.summary())
    return result


def run_gate(
    graphs: dict[str, ExportedGraph], qset: QualitySet, threads: int | None = None
) -> GateResult:
    """Measure every variant of ``graphs`` (fp32 among them) and pick the default."""
    from routing.prompt import PromptFormatter

    fmt = PromptFormatter.from_folder(graphs["fp32"].folder)
    probes = {v: _Probe(g, fmt, threads) for v, g in graphs.items()}
    speed = {v: p.decode_ms() for v, p in probes.items()}
    base = probes["fp32"].evaluate(qset)
    scores = [base.scored("fp32", speed["fp32"], None)]
    for variant in sorted(speed, key=speed.__getitem__):
        if variant == "fp32":
            continue
        if speed[variant] >= speed["fp32"]:
            scores.append(VariantScore(variant, speed[variant], why="no faster than fp32"))
            continue
        got = probes[variant].evaluate(qset, base)
        scores.append(got.scored(variant, speed[variant], base))
    passed = sorted((s for s in scores if s.passed), key=lambda s: s.decode_ms)
    chosen = passed[0].variant if passed else "fp32"
    return GateResult(
        chosen=chosen,
        cpu=cpu_signature(),
        set_digest=qset.digest,
        graphs={v: g.meta.created_unix for v, g in graphs.items()},
        scores=tuple(sorted(scores, key=lambda s: VARIANTS.index(s.variant))),
    )


@dataclass
class _Evaluation:
    """What one variant's graph did on the quality set; a check that already failed stops it
    (``nll`` None: the reference answers were not scored)."""

    invariant: bool = True
    correct: int = 0
    total: int = 0
    nll: float | None = None

    def scored(self, variant: str, decode_ms: float, base: _Evaluation | None) -> VariantScore:
        """The variant's score; against ``base`` (fp32's) it says why it fails, if it does."""
        why = []
        if base is not None:
            if not self.invariant:
                why.append("answers change with chunking or batching")
            if self.correct < base.correct - QUESTION_SLACK:
                why.append(f"{self.correct}/{self.total} questions, fp32 {base.correct}")
            if self.nll is not None and base.nll and self.nll > base.nll * (1 + NLL_TOLERANCE):
                why.append(f"NLL {100 * (self.nll / base.nll - 1):+.1f}% of fp32")
        return VariantScore(
            variant, decode_ms, self.nll, self.correct, self.total, self.invariant, "; ".join(why)
        )


class _Probe:
    """One variant's session and two-slot decoder, run the ways the edge engine runs them."""

    def __init__(self, graph: ExportedGraph, fmt: Any, threads: int | None) -> None:
        from edge_runtime.decoder import Decoder
        from edge_runtime.graph_info import read_graph_info
        from edge_runtime.providers import create_session, session_options

        session, _ = create_session(
            graph.graph_path, ["CPUExecutionProvider"], lambda: session_options(threads)
        )
        self.decoder = Decoder(session, read_graph_info(graph.graph_path), 2, 512)
        self.fmt = fmt
        self.eos = set(graph.meta.eos_token_ids)

    def _chat(self, prompt: str) -> list[int]:
        return self.fmt.encode_chat([{"role": "user", "content": prompt}])

    def _prefill(self, slot: int, ids: list[int], chunk: int | None) -> np.ndarray:
        step_ = chunk or len(ids)
        logits = None
        for start in range(0, len(ids), step_):
            logits = self.decoder.prefill(slot, ids[start : start + step_], start)
        assert logits is not None
        return logits

    def decode_ms(self) -> float:
        """The median of ``SPEED_STEPS`` single-stream decode steps after a short prompt."""
        ids = self._chat("Tell me about the sea.")
        token = int(np.argmax(self._prefill(0, ids, None)))
        times = []
        for pos in range(len(ids), len(ids) + SPEED_STEPS):
            t0 = time.perf_counter()
            logits = self.decoder.decode(
                np.array([token], np.int64), np.array([pos], np.int64), np.array([True])
            )
            times.append((time.perf_counter() - t0) * 1e3)
            token = int(np.argmax(logits[0]))
        return round(statistics.median(times), 3)

    def greedy(self, prompt: str, chunk: int | None = None) -> list[int]:
        """Greedy tokens of one answer decoded alone (prompt in ``chunk``-token pieces)."""
        ids = self._chat(prompt)
        out = [int(np.argmax(self._prefill(0, ids, chunk)))]
        while len(out) < ANSWER_TOKENS and out[-1] not in self.eos:
            logits = self.decoder.prefill(0, [out[-1]], len(ids) + len(out) - 1)
            out.append(int(np.argmax(logits)))
        return out

    def greedy_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """Greedy tokens of two answers decoded together in one batch, prompts chunked."""
        prompts = [self._chat(first), self._chat(second)]
        outs = [[int(np.argmax(self._prefill(s, p, CHUNK)))] for s, p in enumerate(prompts)]
        done = [o[-1] in self.eos for o in outs]
        while not all(done):
            tokens = np.array([o[-1] for o in outs], np.int64)
            lengths = np.array(
                [len(p) + len(o) - 1 for p, o in zip(prompts, outs, strict=True)], np.int64
            )
            logits = self.decoder.decode(tokens, lengths, ~np.array(done))
            for row, out in enumerate(outs):
                if not done[row]:
                    out.append(int(np.argmax(logits[row])))
                    done[row] = len(out) >= ANSWER_TOKENS or out[-1] in self.eos
        return outs[0], outs[1]

    def nll(self, prompt: str, answer: str) -> tuple[float, int]:
        """Summed NLL of ``answer``'s tokens after ``prompt``, and their count."""
        ids = self._chat(prompt)
        target = self.fmt.encode(answer)
        logits = self._prefill(0, ids, None)
        total = 0.0
        for i, token in enumerate(target):
            z = logits.astype(np.float64)
            total += float(np.log(np.exp(z - z.max()).sum()) + z.max() - z[token])
            if i + 1 < len(target):
                logits = self.decoder.prefill(0, [token], len(ids) + i)
        return total, len(target)

    def evaluate(self, qset: QualitySet, base: _Evaluation | None = None) -> _Evaluation:
        """Invariance, plain questions, then reference NLL; against ``base`` (fp32's) it stops
        at the first check that fails."""
        out = _Evaluation(total=len(qset.questions))
        answers = [self.greedy(p) for p, _ in qset.questions]
        # questions spread over the set, decoded again chunked, and in pairs in one batch
        picked = list(range(len(answers)))[:: max(1, len(answers) // INVARIANCE_QUESTIONS)]
        picked = picked[: INVARIANCE_QUESTIONS // 2 * 2]
        prompts = [qset.questions[i][0] for i in picked]
        out.invariant = all(
            self.greedy(p, CHUNK) == answers[i] for p, i in zip(prompts, picked, strict=True)
        )
        for k in range(0, len(picked) - 1, 2):
            pair = self.greedy_pair(prompts[k], prompts[k + 1])
            out.invariant = out.invariant and pair == (answers[picked[k]], answers[picked[k + 1]])
        out.correct = sum(
            answers_right(self.fmt.decode(a), accept)
            for a, (_, accept) in zip(answers, qset.questions, strict=True)
        )
        if base is not None and (not out.invariant or out.correct < base.correct - QUESTION_SLACK):
            return out
        sums = [self.nll(p, a) for p, a in qset.references]
        out.nll = round(sum(s for s, _ in sums) / sum(n for _, n in sums), 5)
        return out
