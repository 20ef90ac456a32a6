"""The edge engine: ONNX export of a checkpoint, quantization, execution-provider choice, and
the slot-based generation loop over an ONNX decoder graph with an in-place KV cache.

Modules: ``export`` (cached exports; torch only inside the ``torch_*`` modules), ``quantize``,
``graph_passes``, ``graph_info``, ``providers``, ``decoder`` (session + KV buffers),
``scheduler`` (the blocking slot loop), ``slot_cache`` (a finished request's KV kept in its slot
for prefix reuse), ``sampler`` and ``engine`` (``EdgeEngine``, the
:class:`routing.engine.Engine` of kind ``"edge"``).
"""
