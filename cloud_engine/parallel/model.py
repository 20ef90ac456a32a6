"""The Llama family (Llama, Qwen2, Qwen3, Mistral) sharded over TP ranks and cut into PP stages.

Tensor parallelism (Megatron style): q/k/v are one column-parallel ``qkv`` weight (each rank
holds its query heads and their KV heads), ``o_proj`` is row-parallel, gate and up are one
column-parallel ``gate_up`` weight, ``down_proj`` is row-parallel; one all-reduce after the
attention and one after the MLP. The vocabulary is padded to a multiple of ``tp``; each rank
embeds its vocabulary rows (the others zero, then an all-reduce) and computes its slice of the
logits.

KV heads: with ``tp <= kv_heads`` each rank holds whole KV groups (a KV head and its query
heads), as evenly as possible when ``tp`` does not divide them (SmolLM2-135M: 3 KV heads over
2 ranks give 2 and 1; the row-parallel sum does not care); with more ranks
than KV heads (``tp`` a multiple of ``kv_heads``) each rank holds the one KV head its query
heads use (head ``r * kv_heads // tp``), replicated over ``tp / kv_heads`` ranks.

Pipeline parallelism: a stage holds the decoder layers of its range; the first also the
embedding, the last also the final norm and the LM head. Invariant: ``forward`` on every TP
rank of a stage, with the same inputs, returns the same hidden states (all-reduced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cloud_engine.model.config import ModelConfig
from cloud_engine.model.llama import AttentionBackend, Rotary, apply_rotary
from cloud_engine.parallel.checkpoint import Checkpoint
from cloud_engine.parallel.dist import Rank
from cloud_engine.parallel.moe import MoEConfig, SparseMoE, read_config


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dtype)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The heads one TP rank holds: query heads ``[q0, q0 + nq)``, KV heads ``[k0, k0 + nkv)``."""

    q0: int
    nq: int
    k0: int
    nkv: int

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int, r: int) -> HeadShard:
        """Whole KV groups per rank (as even as possible: 3 KV heads over 2 ranks give 2 and
        1), or with more ranks than KV heads (``tp`` a multiple of them) one replicated KV
        head per rank and an even split of the query heads."""
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        g = hq // hkv
        if tp <= hkv:
            k0, k1 = r * hkv // tp, (r + 1) * hkv // tp
            return cls(k0 * g, (k1 - k0) * g, k0, k1 - k0)
        if tp % hkv or hq % tp:
            raise ValueError(f"tp={tp} must be at most, or a multiple of, the {hkv} KV heads")
        nq = hq // tp
        return cls(r * nq, nq, r * hkv // tp, 1)


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


class ShardedLayer:
    """One decoder layer's shard (plain tensors; ``local`` is its index in this rank's pool)."""

    def __init__(
        self,
        ck: Checkpoint,
        cfg: ModelConfig,
        heads: HeadShard,
        rank: Rank,
        layer: int,
        local: int,
        moe: MoEConfig | None = None,
    ) -> None:
        p = f"model.layers.{layer}."
        d = cfg.head_dim
        tp, r = rank.config.tp, rank.tp_rank
        self.local, self.heads, self.cfg, self.rank = local, heads, cfg, rank
        qa, qb = heads.q0 * d, (heads.q0 + heads.nq) * d
        ka, kb = heads.k0 * d, (heads.k0 + heads.nkv) * d
        a = p + "self_attn."
        self.w_qkv = torch.cat(
            [
                ck.rows(a + "q_proj.weight", qa, qb),
                ck.rows(a + "k_proj.weight", ka, kb),
                ck.rows(a + "v_proj.weight", ka, kb),
            ]
        )
        self.b_qkv = None
        if ck.has(a + "q_proj.bias"):
            self.b_qkv = torch.cat(
                [
                    ck.rows(a + "q_proj.bias", qa, qb),
                    ck.rows(a + "k_proj.bias", ka, kb),
                    ck.rows(a + "v_proj.bias", ka, kb),
                ]
            )
        self.w_o = ck.cols(a + "o_proj.weight", qa, qb)
        self.q_norm = ck.full(a + "q_norm.weight") if cfg.qk_norm else None
        self.k_norm = ck.full(a + "k_norm.weight") if cfg.qk_norm else None
        self.moe = SparseMoE(ck, moe, layer, tp, r) if moe and moe.is_sparse(layer) else None
        if self.moe is None:
            inter = cfg.intermediate_size  # split as evenly as possible (row-parallel: any split)
            ia, ib = r * inter // tp, (r + 1) * inter // tp
            m = p + "mlp."
            self.w_gate_up = torch.cat(
                [ck.rows(m + "gate_proj.weight", ia, ib), ck.rows(m + "up_proj.weight", ia, ib)]
            )
            self.w_down = ck.cols(m + "down_proj.weight", ia, ib)
        self.ln1 = ck.full(p + "input_layernorm.weight")
        self.ln2 = ck.full(p + "post_attention_layernorm.weight")
        self.q_size, self.kv_size = heads.nq * d, heads.nkv * d

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        b, t, _ = x.shape
        qkv = F.linear(_rms(x, self.ln1, eps), self.w_qkv, self.b_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(b, t, self.heads.nq, cfg.head_dim)
        k = k.reshape(b, t, self.heads.nkv, cfg.head_dim)
        v = v.reshape(b, t, self.heads.nkv, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = _rms(q, self.q_norm, eps), _rms(k, self.k_norm, eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(self.local, q, k, v)
        x = x + self.rank.all_reduce(F.linear(out.reshape(b, t, self.q_size), self.w_o))
        h = _rms(x, self.ln2, eps)
        if self.moe is not None:
            return x + self.rank.all_reduce(self.moe(h))
        g, u = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return x + self.rank.all_reduce(F.linear(F.silu(g) * u, self.w_down))


class ShardedLlama(torch.nn.Module):
    """This rank's part of the model. ``config`` is the whole model's; ``kv_heads`` and
    ``layers`` say what this rank's KV pool must hold."""

    def __init__(self, folder: str, rank: Rank, layers: range, dtype: torch.dtype) -> None:
        super().__init__()
        ck = Checkpoint(folder, dtype, rank.device)
        cfg, moe = read_config(folder)
        self.config, self.moe, self.rank, self.layers = cfg, moe, rank, layers
        self.heads = HeadShard.of(cfg, rank.config.tp, rank.tp_rank)
        tp, r = rank.config.tp, rank.tp_rank
        self.vocab = cfg.vocab_size
        self.vocab_local = padded_vocab(cfg.vocab_size, tp) // tp
        self.v0 = r * self.vocab_local
        self.first, self.last = rank.first_stage, rank.last_stage
        self.embed = None
        if self.first:
            self.embed = ck.rows_padded(
                "model.embed_tokens.weight", self.v0, self.v0 + self.vocab_local
            )
        self.blocks = [
            ShardedLayer(ck, cfg, self.heads, rank, i, j, moe) for j, i in enumerate(layers)
        ]
        self.norm = self.head = None
        if self.last:
            self.norm = ck.full("model.norm.weight")
            name = (
                "model.embed_tokens.weight"
                if cfg.tie_word_embeddings or not ck.has("lm_head.weight")
                else "lm_head.weight"
            )
            if name.startswith("model.embed") and self.embed is not None:
                self.head = self.embed
            else:
                self.head = ck.rows_padded(name, self.v0, self.v0 + self.vocab_local)
        self.rotary = Rotary(cfg).to(rank.device)
        # a parameter so that ``next(model.parameters())`` gives the dtype and device
        self.anchor = torch.nn.Parameter(
            torch.empty(0, dtype=dtype, device=rank.device), requires_grad=False
        )

    @property
    def kv_heads(self) -> int:
        return self.heads.nkv

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        local = ids - self.v0
        mine = (local >= 0) & (local < self.vocab_local)
        x = F.embedding(local.clamp(0, self.vocab_local - 1), self.embed)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.rank.all_reduce(x)

    def forward_stage(
        self,
        ids: torch.Tensor | None,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The stage's layers over ``[1, N]`` inputs: token ids on the first stage, the previous
        stage's hidden states on the others. The final norm is left to :meth:`logits`."""
        x = self.embed_ids(ids) if hidden is None else hidden
        assert x is not None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for blk in self.blocks:
            x = blk.forward(x, cos, sin, backend)
        return x

    def local_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``[M, vocab_local]`` logits of this rank's vocabulary slice (padding rows -inf)."""
        assert self.norm is not None and self.head is not None
        logits = F.linear(_rms(hidden_rows, self.norm, self.config.rms_norm_eps), self.head).float()
        return self.mask_padding(logits)

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [M, vocab_local]`` with the padding rows of the vocabulary at -inf."""
        pad = self.v0 + self.vocab_local - self.vocab
        if pad > 0:
            logits[:, self.vocab_local - pad :] = float("-inf")
        return logits

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax over the whole vocabulary, as one process would take it (first maximum)."""
        val, idx = logits.max(dim=-1)
        if self.rank.config.tp == 1:
            return idx
        pair = torch.stack([val.double(), (idx + self.v0).double()], dim=1)
        allp = torch.stack(self.rank.all_gather(pair))  # [tp, M, 2]
        best = allp[:, :, 0].argmax(dim=0)  # first rank holding the maximum: lowest index
        return allp[best, torch.arange(allp.shape[1]), 1].long()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.rank.all_gather(logits), dim=1)[:, : self.vocab]
