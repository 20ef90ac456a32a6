"""``ensure_export``: a model (store name or HF folder) as a cached ONNX decoder graph.

Cache layout: ``<home>/onnx/<model identity>/<variant>[-concat]/`` holding ``model.onnx``,
``model.onnx.data``, the tokenizer files and ``edgecloud_export.json`` (:class:`ExportMeta`).

Invariants:
- A cache folder appears only complete: it is built in a temporary sibling and renamed.
- It is reused while the model's identity is unchanged (the identity is part of the path and is
  checked against the JSON); a new identity means a new folder, i.e. a fresh export. A folder
  written by an older export format (``META_FORMAT``) is rebuilt in place.
- Quantized variants are made from the fp32 graph of the same attention flavour (exported
  first if missing), never from torch directly. A folder made by another quantization than
  ``QUANTIZATION`` names (an older per-tensor ``int8``) is rebuilt in place.
- Concurrent callers serialize on a file lock; the second one finds the first one's result.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from edge_runtime.graph_info import GRAPH_FILE, META_FORMAT, ExportMeta
from routing.model_store import ModelInfo, home_dir, resolve
from routing.progress import step
from routing.prompt import TOKENIZER_FILES

log = logging.getLogger(__name__)

VARIANTS = ("fp32", "int8", "int4")
ATTENTIONS = ("gqa", "concat")
DATA_FILE = GRAPH_FILE + ".data"
QUANTIZATION = {"fp32": "", "int8": "affine32-smooth", "int4": ""}  # how each variant is made


@dataclass(frozen=True)
class ExportedGraph:
    folder: Path
    meta: ExportMeta

    @property
    def graph_path(self) -> Path:
        return self.folder / self.meta.graph_file


def onnx_root() -> Path:
    return home_dir() / "onnx"


def export_folder(info: ModelInfo, variant: str, attention: str, root: Path | None = None) -> Path:
    name = variant if attention == "gqa" else f"{variant}-{attention}"
    return (root or onnx_root()) / info.identity / name


def _valid(folder: Path, info: ModelInfo, variant: str, attention: str) -> ExportMeta | None:
    meta = ExportMeta.read(folder)
    if meta is None or not (folder / meta.graph_file).is_file() or meta.format != META_FORMAT:
        return None
    if (meta.model_identity, meta.variant, meta.attention) != (info.identity, variant, attention):
        return None
    made = meta.quantization or ("per_tensor" if variant == "int8" else "")
    return meta if made == QUANTIZATION[variant] else None


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for pkg in ("edgecloud", "torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def ensure_export(
    model: str | os.PathLike[str],
    variant: str = "fp32",
    attention: str = "gqa",
    *,
    root: Path | None = None,
    force: bool = False,
) -> ExportedGraph:
    """The cached export of ``model`` in ``variant``, exporting (and quantizing) if needed.

    The fp32 torch export of the default model takes about a minute and ~1.2 GB of memory.
    ``force`` rebuilds this variant (not the fp32 graph it is quantized from).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")
    quantization = QUANTIZATION[variant]
    info = resolve(model)
    folder = export_folder(info, variant, attention, root)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        meta = None if force else _valid(folder, info, variant, attention)
        if meta is not None:
            return ExportedGraph(folder, meta)
        source = None
        if variant != "fp32":
            source = ensure_export(model, "fp32", attention, root=root).graph_path
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            if source is None:
                with step(f"exporting {info.name} to ONNX (fp32, {attention} attention)"):
                    _export_fp32(info, tmp / GRAPH_FILE, attention)
            else:
                from edge_runtime.quantize import quantize

                with step(f"quantizing {info.name} to {variant}"):
                    quantize(variant, source, tmp / GRAPH_FILE)
            meta = _write_meta(
                info, tmp, variant, attention, time.perf_counter() - t0, quantization
            )
            _replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.debug(
            "exported %s %s (%s) in %.1f s", info.name, variant, attention, meta.export_seconds
        )
        return ExportedGraph(folder, meta)


def _export_fp32(info: ModelInfo, graph_path: Path, attention: str) -> None:
    import onnx

    from edge_runtime.graph_passes import (
        add_logits_to_keep,
        fuse_skip_norms,
        implicit_gqa_positions,
        name_axes,
    )
    from edge_runtime.torch_export import export_decoder

    raw = graph_path.parent / "raw"
    export_decoder(info.path, raw / GRAPH_FILE, attention)  # type: ignore[arg-type]
    model = onnx.load(str(raw / GRAPH_FILE), load_external_data=True)
    name_axes(model)
    fuse_skip_norms(model)
    add_logits_to_keep(model)
    implicit_gqa_positions(model)
    onnx.save_model(
        model,
        str(graph_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=1024,
    )
    shutil.rmtree(raw)


def _write_meta(
    info: ModelInfo,
    folder: Path,
    variant: str,
    attention: str,
    seconds: float,
    quantization: str = "",
) -> ExportMeta:
    from cloud_engine.model.config import ModelConfig
    from routing.prompt import PromptFormatter

    cfg = ModelConfig.from_folder(info.path)
    for name in TOKENIZER_FILES:
        src = info.path / name
        if src.is_file():
            shutil.copy2(src, folder / name)
    stops: list[int] = []
    if (info.path / "tokenizer.json").is_file():
        stops = list(PromptFormatter.from_folder(info.path).stop_token_ids)
    meta = ExportMeta(
        model_name=info.name,
        model_identity=info.identity,
        variant=variant,
        attention=attention,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        context_length=cfg.max_position_embeddings,
        tokenizer_dir=".",
        eos_token_ids=stops or list(cfg.eos_token_id),
        export_seconds=round(seconds, 2),
        created_unix=time.time(),
        tool_versions=tool_versions(),
        quantization=quantization,
    )
    meta.write(folder)
    return meta


def _replace(tmp: Path, folder: Path) -> None:
    """Move ``tmp`` to ``folder``; an existing folder is moved aside first, then removed."""
    old = None
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        folder.rename(old)
    tmp.rename(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
