"""Tensor and pipeline parallelism for the cloud engine (one scheduler on the driver rank).

Modules: ``dist`` (the rank layout, process groups, collectives with timeouts), ``protocol``
(each step's metadata packed into int64 tensors), ``model`` (the Llama family sharded over
tensor-parallel ranks and partitioned into pipeline stages, loaded shard by shard from the HF
checkpoint), ``runner`` (the driver's runner and the workers' loop), ``pipeline`` (the batch
queue that keeps one batch per stage in flight) and ``launch`` (starting rank processes on one
host, or joining a ``torchrun`` world).
"""
