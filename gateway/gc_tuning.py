"""The cyclic garbage collector kept off the request path of a long-lived server process.

What exists once a process has started (modules, the model's modules and parameters,
tokenizers, schemas, routes) lives as long as the process. Unfrozen, every full collection
walks all of it: in a cloud node's process 363,000 objects, 136 ms (`python bench/gc_pause.py`),
a pause of every thread, the engine's step thread included. Frozen after start-up, full
collections walk only what came later.
"""

from __future__ import annotations

import gc


def tune_gc(young_threshold: int = 10_000) -> None:
    """Keep the cyclic garbage collector off the request path.

    Call once the process has started (see the module): what exists then is frozen. A
    request's objects are freed by reference counting; a larger young generation makes the
    collector run less often for the few that form cycles.
    """
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    if threshold[0] and threshold[0] < young_threshold:
        gc.set_threshold(young_threshold, *threshold[1:])
