"""The cloud engine: a paged, prefix-caching, continuously batching torch engine.

Layers, bottom up (each module holds one of them):

- ``kv_pool``: the one pre-allocated KV region, in 16-token blocks (optionally int8);
- ``block_manager``: ref-counted blocks, the prefix cache keyed by ``routing.blocks`` hashes,
  LRU eviction, integrity check, stored/removed events;
- ``sequence`` and ``scheduler``: per-request state; continuous batching with chunked prefill,
  priorities and preemption by recompute;
- ``step_inputs``, ``runner`` (torch, any device) and ``cuda_runner`` (fused weights, Triton
  ``kernels``, CUDA graphs): one forward pass over the pool;
- ``admission`` (request checks), ``inflight`` (launched batches, the look-ahead step),
  ``outputs`` (committing sampled tokens) and ``step_stats`` (counters, rates): the parts
  of a step;
- ``core``: one synchronous step; ``engine.CloudEngine``: the async ``routing.engine.Engine``.

Nothing is imported here, so importing the package costs nothing; use
``from cloud_engine.engine import CloudEngine``.
"""
