"""What the latency model assumes before it has measured anything, and its fixed constants.

These are not settings: they are starting points the model's own measurements replace (rates)
or the statistics' fixed parameters. A node's own report (its NodeState) overrides a prior.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.fleet.state import NodeKind, NodeState


@dataclass(frozen=True, slots=True)
class KindPriors:
    """What to assume about a node of one kind before it reports or is measured."""

    prefill_tokens_per_s: float
    decode_ms_per_token: float  # one sequence, batch 1
    batch_slope: float  # relative decode slowdown per extra sequence, until fitted
    prefill_chunk: int = 256  # prompt tokens per engine step, where the node reports none
    # its engine runs a prompt's chunk and the decode rows as one step (the cloud engine)
    mixed_steps: bool = False
    # a prompt token's prefill cost with prompt logprobs (echo: every position through the LM
    # head and a log-softmax) against without (bench/logprob_cost.py: 1.63x edge, 1.25x cloud
    # on 400-token prompts; decode logprobs cost nothing measurable, 1.01-1.02x)
    prompt_logprob_cost: float = 1.0


EDGE = KindPriors(400.0, 30.0, 0.6, prefill_chunk=256, prompt_logprob_cost=1.6)
CLOUD = KindPriors(
    6000.0, 20.0, 0.03, prefill_chunk=1024, mixed_steps=True, prompt_logprob_cost=1.25
)
# a cloud node whose torch device is a CPU: 130-270 prompt tokens/s, 55-95 ms a one-row step
CLOUD_CPU = KindPriors(
    250.0, 60.0, 0.25, prefill_chunk=1024, mixed_steps=True, prompt_logprob_cost=1.25
)
OPENAI = KindPriors(3000.0, 25.0, 0.0)

RATE_ALPHA = 0.2  # EWMA weight of a new rate sample
ERROR_ALPHA = 0.05  # EWMA weight of a new prediction error (/admin/nodes, /metrics)
SELF_REPORT_WEIGHT = 0.3  # share a node's own reported rates keep against measured ones
WARMUP_SAMPLES = 3  # observations before measured rates are fully trusted
MIN_PREFILL_TOKENS = 32  # uncached tokens a prompt needs to teach the prefill rate
MIN_DECODE_TOKENS = 4  # completion tokens a reply needs to teach the decode rate
SERVICE_OUTPUT_TOKENS = 128.0  # output assumed of a request in hand on a node never measured
# share of its prefill or decode a request in flight is taken to have left once it runs late
# against its prediction (how far along it is is not known: the mean of a uniform guess)
OVERRUN_LEFT = 0.5
ARRIVAL_WINDOW_S = 10.0  # the recent past a node's typical newcomer is taken over
# how far a request's predicted decode moves toward the replay with future arrivals
# (geometric blend: 0 ignores them, 1 takes them in full)
ARRIVAL_WEIGHT = 0.5


def on_cpu(device: str) -> bool:
    """Whether a node's device (torch device, execution provider, or provider and device as
    ``"OpenVINO:CPU"``) is a CPU."""
    low = device.lower()
    return low.startswith("cpu") or low.endswith(":cpu")


def kind_priors(kind: NodeKind, device: str | None = None) -> KindPriors:
    """The priors of a node of ``kind`` (a cloud node on a CPU ``device`` takes its own)."""
    if kind == NodeKind.EDGE:
        return EDGE
    if kind == NodeKind.CLOUD:
        return CLOUD_CPU if device is not None and on_cpu(device) else CLOUD
    return OPENAI


def prompt_cost(node: NodeState) -> float:
    """A prompt token's prefill cost on ``node`` with prompt logprobs, in ordinary tokens."""
    return kind_priors(node.kind, node.device).prompt_logprob_cost
