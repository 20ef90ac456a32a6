"""What one full garbage collection costs a cloud node's process, its start-up objects frozen
(``gateway.gc_tuning.tune_gc``, what every node and the gateway do once started) or not.

The process loads what a cloud node holds once it serves (the torch engine on the model, the
node and gateway apps' modules, the prompt formatter), runs a few requests through the engine,
then times ``gc.collect()`` unfrozen; the peer in the same run is the same collection after
``tune_gc``. A full collection stops every thread of the process, the engine's step thread
included.

    python bench/gc_pause.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results


def full_collection_us(n: int) -> tuple[float, int]:
    """Median microseconds of ``n`` full collections, and the objects each walked."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times), len(gc.get_objects())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeat", type=int, default=5, help="collections timed each way")
    args = ap.parse_args(argv)

    import torch

    import gateway.front.app  # what a node process imports, and the gateway's
    import gateway.node.app  # noqa: F401
    from cloud_engine.engine import CloudEngine
    from gateway.gc_tuning import tune_gc
    from routing.engine import GenerationRequest, SamplingParams
    from routing.model_store import resolve
    from routing.prompt import PromptFormatter

    torch.set_num_threads(1)
    engine = CloudEngine.from_model(args.model, "cpu", kv_memory_bytes=256 << 20)
    PromptFormatter.from_folder(resolve(args.model).path).encode_chat(
        [{"role": "user", "content": "warm the template"}]
    )
    core = engine.core
    for i in range(8):
        core.add(
            GenerationRequest(
                [1000 + 7 * i + j for j in range(40)], SamplingParams(max_tokens=8, temperature=0.0)
            )
        )
        while core.has_work():
            core.step()
    rows = []
    for label in ("unfrozen", "frozen"):
        if label == "frozen":
            tune_gc()
        us, walked = full_collection_us(args.repeat)
        rows.append(
            {"start_up_objects": label, "full_collection_us": round(us), "objects_walked": walked}
        )
    md = table(rows, ["start_up_objects", "full_collection_us", "objects_walked"])
    payload = {
        "command": recorded_command("gc_pause.py", sys.argv[1:], ()),
        "machine": machine(),
        "rows": rows,
    }
    write_results("gc_pause", payload, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
