"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Qwen2-MoE, Mixtral) with expert parallelism.

Config fields read: ``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``,
``moe_intermediate_size`` (Mixtral: ``intermediate_size``), ``norm_topk_prob`` (Mixtral always
renormalises), ``decoder_sparse_step``, ``mlp_only_layers``, ``shared_expert_intermediate_size``
(Qwen2-MoE's shared expert, gated by ``sigmoid(shared_expert_gate(x))``).

Routing as the models define it: ``softmax`` of the router logits in float32, top-k, optionally
renormalised, cast to the activations' dtype. Experts are stacked weights. On CUDA (with Triton)
``cloud_engine.kernels.moe`` runs them: routing and the sort by expert on the device, one
grouped launch for every expert's gate_up (SwiGLU fused) and one for down, no host sync. The CPU
path sorts the (token, expert) pairs by expert and runs one gathered matmul per expert with tokens.

Expert parallelism: TP rank ``r`` of ``tp`` holds whole experts ``[r*E/tp, (r+1)*E/tp)``.
Activations are replicated over the TP ranks (the attention's all-reduce), so dispatch is each
rank selecting the pairs routed to its experts, and the combine is the MLP's one all-reduce
(each rank adds its experts' weighted outputs; the router is replicated and picks the same
experts everywhere). A shared expert is split over the ranks by its intermediate dimension.
Both HF layouts load: per-expert tensors and the packed ``experts.gate_up_proj`` /
``experts.down_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cloud_engine.parallel.checkpoint import Checkpoint

BASE_TYPES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate: int
    norm_topk: bool
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_intermediate: int = 0
    mixtral: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig | None:
        mtype = d.get("model_type", "")
        if mtype not in BASE_TYPES:
            return None
        mixtral = mtype == "mixtral"
        experts = d.get("num_experts") or d.get("num_local_experts")
        return cls(
            num_experts=int(experts),
            top_k=int(d["num_experts_per_tok"]),
            intermediate=int(d["intermediate_size"] if mixtral else d["moe_intermediate_size"]),
            norm_topk=True if mixtral else bool(d.get("norm_topk_prob", False)),
            sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            shared_intermediate=int(d.get("shared_expert_intermediate_size") or 0),
            mixtral=mixtral,
        )

    def is_sparse(self, layer: int) -> bool:
        if self.mixtral:
            return True
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


def base_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The config read as its dense base family (attention, norms, RoPE are the same)."""
    mtype = d.get("model_type", "")
    if mtype not in BASE_TYPES:
        return d
    out = dict(d, model_type=BASE_TYPES[mtype])
    if "qkv_bias" in d and "attention_bias" not in d:
        out["attention_bias"] = bool(d["qkv_bias"])
    out.setdefault("intermediate_size", d.get("moe_intermediate_size", 0))
    return out


class SparseMoE:
    """One layer's experts on this rank (see the module docstring). ``__call__`` returns this
    rank's partial sum; the caller all-reduces."""

    def __init__(self, ck: Checkpoint, mc: MoEConfig, layer: int, tp: int, r: int) -> None:
        p = f"model.layers.{layer}." + ("block_sparse_moe." if mc.mixtral else "mlp.")
        self.cfg = mc
        e = mc.num_experts
        if e % tp:
            raise ValueError(f"{e} experts do not split over tp={tp}")
        self.e0, self.e1 = r * e // tp, (r + 1) * e // tp
        self.router = ck.full(p + "gate.weight")  # replicated: [E, H]
        if ck.has(p + "experts.gate_up_proj"):  # packed layout: [E, 2I, H] and [E, H, I]
            self.w_gate_up = ck.rows(p + "experts.gate_up_proj", self.e0, self.e1)
            self.w_down = ck.rows(p + "experts.down_proj", self.e0, self.e1)
        else:
            g, u, d = ("w1", "w3", "w2") if mc.mixtral else ("gate_proj", "up_proj", "down_proj")
            ex = [f"{p}experts.{i}." for i in range(self.e0, self.e1)]
            self.w_gate_up = torch.stack(
                [torch.cat([ck.full(x + g + ".weight"), ck.full(x + u + ".weight")]) for x in ex]
            )
            self.w_down = torch.stack([ck.full(x + d + ".weight") for x in ex])
        self.shared = None
        if mc.shared_intermediate:
            s = p + "shared_expert."
            n = mc.shared_intermediate
            a, b = r * n // tp, (r + 1) * n // tp
            self.shared = (
                torch.cat(
                    [ck.rows(s + "gate_proj.weight", a, b), ck.rows(s + "up_proj.weight", a, b)]
                ),
                ck.cols(s + "down_proj.weight", a, b),
                ck.full(p + "shared_expert_gate.weight"),
            )

    use_kernel: bool | None = None  # None: the Triton grouped kernel on CUDA when importable

    def _kernel(self, h: torch.Tensor) -> bool:
        if self.use_kernel is None:
            from cloud_engine.kernels import triton_available

            SparseMoE.use_kernel = triton_available()
        return bool(self.use_kernel) and h.is_cuda

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        if self._kernel(h):  # routing, sort and both GEMMs on the device: no host sync
            from cloud_engine.kernels.moe import moe_forward

            out = moe_forward(
                h, self.router, self.w_gate_up, self.w_down, self.cfg.top_k,
                self.cfg.norm_topk, self.e0,
            )  # fmt: skip
            return self._shared(h, out).reshape(shape)
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        w, idx = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(h.dtype)
        out = torch.zeros_like(h)
        flat = idx.reshape(-1)
        mine = (flat >= self.e0) & (flat < self.e1)
        pairs = torch.nonzero(mine).squeeze(1)
        if pairs.numel():
            local = flat[pairs] - self.e0
            order = torch.argsort(local, stable=True)  # sorted by expert
            pairs, local = pairs[order], local[order]
            counts = torch.bincount(local, minlength=self.e1 - self.e0).tolist()
            tok = pairs // self.cfg.top_k
            wt = w.reshape(-1)[pairs].unsqueeze(1)
            a = 0
            for e, c in enumerate(counts):
                if not c:
                    continue
                rows = tok[a : a + c]
                g, u = F.linear(h[rows], self.w_gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.w_down[e])
                out.index_add_(0, rows, y * wt[a : a + c])
                a += c
        return self._shared(h, out).reshape(shape)

    def _shared(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            gu, down, gate = self.shared
            g, u = F.linear(h, gu).chunk(2, dim=-1)
            out = out + torch.sigmoid(F.linear(h, gate)) * F.linear(F.silu(g) * u, down)
        return out


def read_config(folder: str) -> tuple[Any, MoEConfig | None]:
    """``(ModelConfig, MoEConfig or None)`` of a model folder (dense or MoE)."""
    import json
    from pathlib import Path

    from cloud_engine.model.config import ModelConfig

    d = json.loads((Path(folder) / "config.json").read_text())
    return ModelConfig.from_dict(base_config_dict(d)), MoEConfig.from_dict(d)
