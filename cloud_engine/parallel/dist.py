"""The rank layout and the process groups of a TP x PP world.

Layout: ``rank = pp_rank * tp + tp_rank``. The *driver* is rank 0 (stage 0, TP rank 0): it
alone holds the scheduler and the block manager. Stage ``s``'s TP ranks form one group (their
all-reduces); rank ``r`` of stage ``s`` talks point to point with rank ``r`` of stages
``s - 1`` and ``s + 1``.

Invariant: every collective and every point-to-point wait runs under the world's timeout
(``init_process_group(timeout=...)``), so a dead peer turns into an exception, never a hang.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: as even as possible

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_layers(self, num_layers: int) -> list[range]:
        """The decoder layers of each stage (contiguous, in order, covering all)."""
        if self.pp_layers is not None:
            counts = list(self.pp_layers)
            if len(counts) != self.pp or sum(counts) != num_layers or min(counts) < 1:
                raise ValueError(
                    f"--pp-layers {counts} must be {self.pp} counts summing to {num_layers}"
                )
        else:
            if num_layers < self.pp:
                raise ValueError(f"{num_layers} layers cannot make {self.pp} stages")
            base, extra = divmod(num_layers, self.pp)
            counts = [base + (1 if s < extra else 0) for s in range(self.pp)]
        out, a = [], 0
        for c in counts:
            out.append(range(a, a + c))
            a += c
        return out


def layer_weights(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(weights one decoder layer reads per token, weights the LM head reads per token), from
    a Hugging Face ``config.json``; a mixture-of-experts layer counts its active experts."""
    h = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    hd = int(hf.get("head_dim") or h // heads)
    attn = h * hd * (2 * heads + 2 * kv)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        inter = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        mlp = int(hf.get("num_experts_per_tok", 1)) * 3 * h * inter
        mlp += 3 * h * int(hf.get("shared_expert_intermediate_size") or 0)
    else:
        mlp = 3 * h * int(hf["intermediate_size"])
    return float(attn + mlp), float(h * int(hf["vocab_size"]))


def balanced_layers(hf: Mapping[str, Any], pp: int) -> tuple[int, ...]:
    """Layers per stage with the heaviest stage as light as it can be, counting the LM head on
    the last stage (``--pp-layers balanced``): an even split leaves the last stage with the
    head's extra work (eight layers' worth on SmolLM2-135M) and the others waiting for it."""
    layers = int(hf["num_hidden_layers"])
    if layers < pp:
        raise ValueError(f"{layers} layers cannot make {pp} stages")
    if pp == 1:
        return (layers,)
    per_layer, head = layer_weights(hf)
    best: tuple[float, tuple[int, ...]] | None = None
    for last in range(1, layers - pp + 2):
        base, extra = divmod(layers - last, pp - 1)
        counts = tuple([base + (1 if s < extra else 0) for s in range(pp - 1)] + [last])
        cost = max(max(counts[:-1]) * per_layer, last * per_layer + head)
        if best is None or cost < best[0]:
            best = (cost, counts)
    assert best is not None
    return best[1]


def parse_pp_layers(text: str | None, model_folder: str | Path, pp: int) -> tuple[int, ...] | None:
    """``--pp-layers``: None (even), ``balanced`` (see :func:`balanced_layers`) or counts
    such as ``10,14``; raises ValueError with the flag's name for anything else."""
    if not text:
        return None
    if text.strip() == "balanced":
        hf = json.loads((Path(model_folder) / "config.json").read_text())
        return balanced_layers(hf.get("text_config", hf), pp)
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--pp-layers {text!r}: give 'balanced' or one layer count per stage, e.g. 10,14"
        ) from None


@dataclass(frozen=True)
class Rank:
    """This process's place in the world, with its process groups."""

    config: ParallelConfig
    rank: int
    tp_group: object | None  # None when tp == 1
    device: torch.device
    # Metadata (int64 CPU tensors) travels point to point over gloo: the default group on
    # CPU, a gloo copy of the world when the data plane is NCCL.
    ctrl_group: object | None = None  # None: the default group

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.config.tp

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.config.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.config.tp

    @property
    def stage_root(self) -> int:
        """World rank of TP rank 0 of this stage."""
        return self.pp_rank * self.config.tp

    @property
    def last_root(self) -> int:
        """World rank of TP rank 0 of the last stage (it sends the step's result to the driver)."""
        return (self.config.pp - 1) * self.config.tp

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)  # type: ignore[arg-type]
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.tp_group is None:
            return [x]
        out = [torch.empty_like(x) for _ in range(self.config.tp)]
        dist.all_gather(out, x.contiguous(), group=self.tp_group)  # type: ignore[arg-type]
        return out


def backend_for(device: torch.device) -> str:
    return (
        "nccl"
        if device.type == "cuda" and os.environ.get("EDGECLOUD_PP_BACKEND") != "gloo"
        else "gloo"
    )


def init_world(
    config: ParallelConfig,
    rank: int,
    *,
    init_method: str | None = None,
    device: str | torch.device = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Rank:
    """Join the world (``init_method`` or ``env://`` as under torchrun) and make the groups.

    Every rank calls this with the same ``config``; groups are created in the same order
    everywhere, as torch.distributed requires."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(dev),
            init_method=init_method or "env://",
            rank=rank,
            world_size=config.world_size,
            timeout=timeout,
        )
    nccl = backend_for(dev) == "nccl"
    ctrl = dist.new_group(backend="gloo", timeout=timeout) if nccl else None
    tp_group = None
    if config.tp > 1:
        for s in range(config.pp):
            ranks = list(range(s * config.tp, (s + 1) * config.tp))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                tp_group = g
    return Rank(config, rank, tp_group, dev, ctrl)


def min_over_world(value: int, device: torch.device) -> int:
    """The minimum of ``value`` over every rank (KV block counts: the same ids everywhere)."""
    dev = device if backend_for(device) == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
