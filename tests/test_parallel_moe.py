"""Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral),
written by transformers' own classes: our logits match transformers' in float32, and TP=2
with expert parallelism gives the single-process tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_jobs import Job, drive, jobs_rank, mixed_requests

from cloud_engine.attention_torch import TorchPagedBackend, make_meta
from cloud_engine.config import EngineConfig
from cloud_engine.kv_pool import KVPool, KVSpec
from cloud_engine.parallel.build import driver_core
from cloud_engine.parallel.dist import ParallelConfig, Rank
from cloud_engine.parallel.local import run_world
from cloud_engine.parallel.model import ShardedLlama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def _spread(model: torch.nn.Module) -> None:
    """Weights scaled so logits are well spread (HF's 0.02 init leaves near-ties)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / (p.shape[-1] ** 0.5))
            else:
                p.normal_(0.0, 0.02)


def _write(folder: Path, config, cls, packed: bool = False) -> Path:  # type: ignore[no-untyped-def]
    """``save_pretrained`` writes the per-expert layout; ``packed`` writes the in-memory state
    dict as is (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])."""
    torch.manual_seed(11)
    model = cls(config).eval()
    _spread(model)
    model.save_pretrained(folder)
    if packed:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        for f in folder.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers as tf

    root = tmp_path_factory.mktemp("moe")
    return {
        "qwen3_moe": _write(
            root / "qwen3moe",
            tf.Qwen3MoeConfig(
                **COMMON,
                head_dim=16,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            ),
            tf.Qwen3MoeForCausalLM,
        ),
        "qwen3_moe_packed": _write(
            root / "qwen3moe-packed",
            tf.Qwen3MoeConfig(
                **COMMON,
                head_dim=16,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            ),
            tf.Qwen3MoeForCausalLM,
            packed=True,
        ),
        "qwen2_moe": _write(
            root / "qwen2moe",
            tf.Qwen2MoeConfig(
                **COMMON,
                intermediate_size=96,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
            ),
            tf.Qwen2MoeForCausalLM,
        ),
        "mixtral": _write(
            root / "mixtral",
            tf.MixtralConfig(
                **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
            ),
            tf.MixtralForCausalLM,
        ),
    }


ONE = Rank(ParallelConfig(), 0, None, torch.device("cpu"))


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = ShardedLlama(str(folder), ONE, range(model_layers(folder)), torch.float32)
    cfg = model.config
    pool = KVPool(KVSpec(len(model.layers), model.kv_heads, cfg.head_dim, torch.float32), 4, "cpu")
    t = len(ids)
    meta = make_meta(torch.arange(t), torch.arange(4).unsqueeze(0), [0, t], [t])
    with torch.inference_mode():
        hidden = model.forward_stage(
            torch.tensor([ids]), None, torch.arange(t).unsqueeze(0), TorchPagedBackend(pool, meta)
        )
        return model.local_logits(hidden[0])


def model_layers(folder: Path) -> int:
    from cloud_engine.parallel.moe import read_config

    return read_config(str(folder))[0].num_hidden_layers


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_packed", "qwen2_moe", "mixtral"])
def test_logits_match_transformers(moe_models: dict[str, Path], name: str) -> None:
    import transformers as tf

    ids = [
        int(x) for x in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5))
    ]
    ref = tf.AutoModelForCausalLM.from_pretrained(moe_models[name], dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = our_logits(moe_models[name], ids)
    assert want.abs().max().item() > 1.0  # spread logits, not a near-zero comparison
    assert (got - want).abs().max().item() < 1e-4


def test_tp2_expert_parallel_matches_one_process(moe_models: dict[str, Path]) -> None:
    reqs, arrivals = mixed_requests(12, VOCAB, seed=2)
    cfg = EngineConfig(max_kv_blocks=40, max_tokens_per_step=128, debug_checks=True)
    refs, jobs = [], []
    with torch.inference_mode():
        for name, folder in moe_models.items():
            if name.endswith("packed"):
                continue
            core = driver_core(folder, "moe", ONE, cfg)
            refs.append((name, drive(core, reqs, arrivals)))
            jobs.append(Job(str(folder), 2, 1, reqs, arrivals, cfg))
    results = run_world(jobs_rank, 2, jobs, timeout_s=240)
    for (name, ref), got in zip(refs, results, strict=True):
        assert got["tokens"] == ref, name
