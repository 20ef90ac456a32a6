"""What one routing decision costs with requests in hand: the latency and threshold policies.

Every policy's candidates carry the latency model's estimates, and the model replays each
node's engine over the work the gateway has in flight there (``routing/backlog.py``), so both
policies pay for the replay: the rows show how that cost grows with the requests in hand
(against the same decision with none), on one fleet (an edge node with 4 slots, a cloud node
with 64) after ``begin`` of N requests of 300 prompt tokens spread by round robin, in this
process. The peers are the same decision with the literal engine loop
(``tests/replay_oracle.replay_literal``, one pass over the rows per step) in place of the heap
replay the gateway runs, and with the blend's two replays run apart (``two_replays``) in place of ``replay_pair``'s fork at the new request's
first token.

    python bench/decision_cost.py --in-flight 0 16 64 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import routing.latency.estimate
from bench._common import RESULTS, machine, recorded_command, table
from routing import backlog
from routing.backlog import Arrivals, EngineShape, Replayed, Work
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetView
from routing.policy_config import PolicyConfig
from routing.profile import RequestProfile
from routing.router import Router
from tests.replay_oracle import replay_literal


def _fleet(now: float) -> FleetView:
    def node(name: str, kind: NodeKind, slots: int) -> NodeState:
        return NodeState(
            id=name, kind=kind, region="local", url="http://x", models=["m"],
            max_context=8192, device="cpu", max_batch=slots, prefill_tokens_per_s=1000.0,
            decode_ms_per_token=20.0, timestamp=now,
        )  # fmt: skip

    return FleetView(nodes=[node("edge", NodeKind.EDGE, 4), node("cloud", NodeKind.CLOUD, 64)],
                     prefix_blocks={})  # fmt: skip


def cost_us(policy: str, in_flight: int, rounds: int) -> float:
    """Microseconds one ``policy`` decision takes with ``in_flight`` requests in hand."""
    prof = RequestProfile(
        model="m", model_identity="m", route="chat", prompt_token_ids=list(range(300)),
        block_hashes=[], max_tokens=64, expected_output_tokens=64.0, stream=True,
        client_region="local",
    )  # fmt: skip
    view = _fleet(time.time())
    filler = Router(PolicyConfig(policy="round_robin"))
    for _ in range(in_flight):
        filler.begin(filler.decide(prof, view), profile=prof)
    t0 = time.perf_counter()
    for _ in range(rounds):
        filler.decide(prof, view, policy=policy)
    return (time.perf_counter() - t0) / rounds * 1e6


def _apart(
    run: Callable[..., Replayed],
) -> Callable[[EngineShape, Sequence[Work], Work, Arrivals], tuple[Replayed, Replayed]]:
    """``replay_pair`` as two whole runs of ``run``, without arrivals and with them."""

    def pair(
        shape: EngineShape, ahead: Sequence[Work], new: Work, arrivals: Arrivals
    ) -> tuple[Replayed, Replayed]:
        return run(shape, ahead, new), run(shape, ahead, new, arrivals=arrivals)

    return pair


def _with(run: Callable[..., Replayed], in_flight: int, rounds: int) -> float:
    """The latency decision's cost with ``run`` as the gateway's replay, whole runs each."""
    est = routing.latency.estimate
    est.replay, est.replay_pair = run, _apart(run)
    try:
        return cost_us("latency", in_flight, rounds)
    finally:
        est.replay, est.replay_pair = backlog.replay, backlog.replay_pair


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[0, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "decision_cost.json")
    args = ap.parse_args(argv)
    rows = []
    for n in args.in_flight:
        lat, thr = cost_us("latency", n, args.rounds), cost_us("threshold", n, args.rounds)
        literal = _with(replay_literal, n, args.rounds)
        two_replays = _with(backlog.replay, n, args.rounds)
        rows.append({"in_flight": n, "latency_us": round(lat, 1), "threshold_us": round(thr, 1),
                     "latency_literal_loop_us": round(literal, 1),
                     "latency_two_replays_us": round(two_replays, 1),
                     "speedup": round(literal / lat, 2)})  # fmt: skip
    cols = ["in_flight", "latency_us", "latency_two_replays_us",
            "threshold_us",
            "latency_literal_loop_us", "speedup"]  # fmt: skip
    print(table(rows, cols))
    command = recorded_command("decision_cost.py", sys.argv[1:], ("--out",))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": command, "machine": machine(), "results": rows}, indent=2))  # fmt: skip
    args.out.with_suffix(".md").write_text(
        f"# decision_cost\n\n`{command}`\n\n{table(rows, cols)}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
