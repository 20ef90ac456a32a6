"""Running a whole world on one host from Python (tests, the benchmark): spawned rank processes.

:func:`run_world` starts ``world`` processes (``spawn``), each bound to this process (Linux
parent-death signal), runs ``target(rank, world, init_method, *args)`` in each and returns rank
0's return value; any rank failing fails the call (after ``timeout_s`` at most).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    target: Callable[..., Any], rank: int, world: int, init: str, args: tuple[Any, ...], q: Any
) -> None:
    from routing.supervisor import set_parent_death_signal

    set_parent_death_signal()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        out = target(rank, world, init, *args)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise


def run_world(target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0) -> Any:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, init, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            try:
                rank, status, out = q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world)) - set(results))} gave no result"
                    ) from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results[0]
