"""One ONNX decoder session and the KV cache of its slots, bound with IOBinding.

Two cache layouts, chosen by the graph (see ``graph_info``):

``gqa`` (in place). Per layer one k and one v buffer ``[slots, kv_heads, context, head_dim]``,
allocated once. A run binds a contiguous range of slots as both ``past_key_values.N.*`` and
``present.N.*`` (same memory); GroupQueryAttention writes each row's new keys and values at that
row's own length, given by the row's ``attention_mask`` (right padded). Nothing is reallocated
and nothing but the new tokens' keys and values is written per step. Decode batches the rows of
slots ``F..F+B-1`` (the lowest to the highest decoding slot); rows of idle or still-prefilling
slots in between are dummies that write one position at the length the caller gives (past
what the slot holds, so it is harmless).

``concat`` (portable graphs, ``present = concat(past, new)``). Each slot has two buffers of
``kv_heads * context * head_dim`` values per layer; a run reads ``past`` from one and writes
``present`` into the other, then they swap; the graph's own Concat copies the slot's cache once
per step (inherent in that graph form). A decode step of several slots runs them as one batch:
their caches are gathered into ``[B, kv_heads, P, head_dim]`` (P = the longest, shorter rows
zero-padded and masked out, the new token at index P for every row), and each row's valid part
plus its new position is scattered back afterwards. The gather and scatter copy the caches once
more, which costs far less than reading the weights once per slot; their buffers grow to the
largest batch seen and are reused. A slot's buffer holds its sequence as
``[kv_heads, n, head_dim]`` for the length ``n`` it was last written with (``_len``); a run
from a shorter ``start`` (a kept prefix reused, see ``edge_runtime.slot_cache``) first re-lays
the first ``start`` positions as ``[kv_heads, start, head_dim]`` (one copy of them).

Decode steps of the ``gqa`` layout touch as little as possible per token: each range of slots has
one binding, made once, whose KV, ``input_ids``, ``position_ids``, ``logits_to_keep`` and
``logits`` are bound to persistent buffers (ids and positions are rewritten in place); only the
``attention_mask``, whose length grows, is bound again per step (a view of a buffer of ones when
one row decodes). The host work between two runs is what a token costs beyond the graph, and it
runs cold: each run streams the weights through the caches, evicting the interpreter's own data,
so a Python call that takes 1-2 us in a tight loop takes 10-30 us there. Hence a decode step
rebinds the mask as an ``OrtValue`` made once per ``(rows, length)`` (views of the persistent
buffers, rewritten in place), and binds and runs through the pybind objects behind
onnxruntime's Python wrappers when this onnxruntime exposes them (the wrappers check WebGPU graph
capture and build an ``OrtDevice`` on every call); otherwise through the public wrappers.

Invariants: ``prefill(slot, tokens, start)`` requires positions ``0..start-1`` of the slot to
hold the sequence's cache and leaves ``0..start+len(tokens)-1`` valid; the positions after a
slot's sequence may hold anything (a kept longer sequence, a dummy row's write), so ``start``
may lie below the length last written; callers never exceed ``context`` positions per slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from edge_runtime.graph_info import GraphInfo

_ORT_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class Decoder:
    """Runs prefill chunks and batched decode steps; owns the KV buffers of ``slots`` slots."""

    def __init__(
        self, session: ort.InferenceSession, info: GraphInfo, slots: int, context: int
    ) -> None:
        if info.extra_inputs:
            raise ValueError(f"graph needs inputs this runtime does not feed: {info.extra_inputs}")
        self.session, self.info = session, info
        self.slots, self.context = slots, context
        self.kv_dtype = np.dtype(info.kv_dtype)
        logits_meta = next(o for o in session.get_outputs() if o.name == "logits")
        self.logits_dtype = np.dtype(_ORT_TO_NUMPY.get(logits_meta.type, np.float32))
        self.vocab = info.vocab_size
        h, d = info.num_kv_heads, info.head_dim
        self._names = [
            (info.past_name(i, kv), info.present_name(i, kv))
            for i in range(info.num_layers)
            for kv in ("key", "value")
        ]
        # Every page is written once here: GroupQueryAttention touches a bound row's whole
        # capacity on its first run anyway, so commit the memory up front (a predictable RSS,
        # and no page-fault storm inside the first request).
        if info.attention == "gqa":
            self._kv = [np.empty((slots, h, context, d), self.kv_dtype) for _ in self._names]
            for buf in self._kv:
                buf.fill(0)
        else:
            self._pp = [
                [[np.zeros(h * context * d, self.kv_dtype) for _ in self._names] for _ in (0, 1)]
                for _ in range(slots)
            ]
            self._cur = [0] * slots
            self._len = [0] * slots  # the sequence length the current buffer is laid out for
            self._batch_past: list[np.ndarray] = []  # gather buffers, grown on demand
            self._batch_present: list[np.ndarray] = []
        self._bindings: dict[tuple[str, int], ort.IOBinding] = {}
        self._keep: list[np.ndarray] = []  # inputs bound for the current run
        # an overridable initializer: IOBinding accepts it only as an OrtValue
        self._keep_last = ort.OrtValue.ortvalue_from_numpy(np.ones(1, np.int64))
        self._keep_all = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int64))
        if self.vocab:
            self._logits = np.zeros((slots, self.vocab), self.logits_dtype)
        # decode inputs: bound once per binding, rewritten in place per step
        self._ids = np.zeros((slots, 1), np.int64)
        self._pos = np.zeros((slots, 1), np.int64)
        self._ones = np.ones(context, np.int64)  # the mask of one row, as a view of any length
        self._mask = np.zeros(slots * context, np.int64)  # the masks of several rows
        self._arange = np.arange(context, dtype=np.int64)
        # decode masks bound as OrtValues over _ones / _mask, one per (rows, length) seen (at
        # most slots * context, a few hundred bytes each)
        self._mask_values: dict[tuple[int, int], ort.OrtValue] = {}
        self._c_session = getattr(session, "_sess", None)  # the pybind session, if exposed

    @property
    def kv_bytes(self) -> int:
        per = 2 if self.info.attention == "concat" else 1
        h, d = self.info.num_kv_heads, self.info.head_dim
        return per * len(self._names) * self.slots * h * self.context * d * self.kv_dtype.itemsize

    # --- bindings ---------------------------------------------------------------------------

    def _gqa_binding(self, first: int, rows: int, kind: str) -> ort.IOBinding:
        key = (kind, first, rows)
        io = self._bindings.get(key)
        if io is None:
            io = self.session.io_binding()
            shape = [rows, self.info.num_kv_heads, self.context, self.info.head_dim]
            for buf, (past, present) in zip(self._kv, self._names, strict=True):
                ptr = _ptr(buf[first:])
                io.bind_input(past, "cpu", 0, self.kv_dtype, shape, ptr)
                io.bind_output(present, "cpu", 0, self.kv_dtype, shape, ptr)
            if kind == "decode":
                self._bind_decode_inputs(io, rows)
            self._bindings[key] = io
        return io

    def _bind_decode_inputs(self, io: ort.IOBinding, rows: int) -> None:
        """Bind a decode step's fixed-shape inputs and outputs to the persistent buffers."""
        i64 = np.int64
        io.bind_input("input_ids", "cpu", 0, i64, [rows, 1], _ptr(self._ids))
        if self.info.has_position_ids:
            io.bind_input("position_ids", "cpu", 0, i64, [rows, 1], _ptr(self._pos))
        if self.info.has_logits_to_keep:
            io.bind_ortvalue_input("logits_to_keep", self._keep_last)
        if self.vocab:  # one new token per row: logits are [rows, 1, vocab]
            shape = [rows, 1, self.vocab]
            io.bind_output("logits", "cpu", 0, self.logits_dtype, shape, _ptr(self._logits))
        else:
            io.bind_output("logits", "cpu")

    def _bind_step(
        self,
        io: ort.IOBinding,
        ids: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
        logits_rows: int | None,
    ) -> None:
        """Bind the token inputs; logits go to the preallocated buffer when ``logits_rows``."""
        self._keep = [ids, mask, positions]
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", mask)
        if self.info.has_position_ids:
            io.bind_cpu_input("position_ids", positions)
        if self.info.has_logits_to_keep:
            io.bind_ortvalue_input("logits_to_keep", self._keep_last)
        if logits_rows is not None and self.vocab and self.info.has_logits_to_keep:
            shape = [logits_rows, 1, self.vocab]
            io.bind_output("logits", "cpu", 0, self.logits_dtype, shape, _ptr(self._logits))
        else:
            io.bind_output("logits", "cpu")

    def _run(self, io: ort.IOBinding, rows: int) -> np.ndarray:
        """Run; the last position's logits of each row (see :meth:`_logits_of`)."""
        self.session.run_with_iobinding(io)
        return self._logits_of(io, rows)

    def _logits_of(
        self, io: ort.IOBinding, rows: int, preallocated: bool | None = None
    ) -> np.ndarray:
        """The last position's logits of each row of the run just made, ``[rows, vocab]``
        float32.

        ``preallocated``: logits were bound to ``self._logits`` (default: when the graph can
        keep only the last position's logits and the vocabulary is known)."""
        if preallocated is None:
            preallocated = bool(self.vocab and self.info.has_logits_to_keep)
        if preallocated:
            out = self._logits[:rows]
        else:
            # presents are bound first (when the binding is made), logits after them
            out = io.get_outputs()[len(self._names)].numpy()[:, -1, :]
        return out if out.dtype == np.float32 else out.astype(np.float32)

    # --- public API ---------------------------------------------------------------------------

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
        """Feed ``tokens`` at positions ``start..``; the logits ``[vocab]`` after the last one."""
        io = self._prefill_binding(slot, tokens, start, 1)
        out = self._run(io, 1)[0]
        if self.info.attention == "concat":
            self._cur[slot] ^= 1
        return out

    def prefill_all(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
        """As :meth:`prefill`, but the logits ``[len(tokens), vocab]`` after every one of them
        (prompt logprobs): ``logits_to_keep`` is fed 0, which keeps every position."""
        t = len(tokens)
        io = self._prefill_binding(slot, tokens, start, None)
        if self.info.has_logits_to_keep:
            io.bind_ortvalue_input("logits_to_keep", self._keep_all)
        self.session.run_with_iobinding(io)
        out = io.get_outputs()[len(self._names)].numpy()[0]
        if self.info.attention == "concat":
            self._cur[slot] ^= 1
        if out.shape[0] != t:
            raise RuntimeError(f"the graph returned {out.shape[0]} logits rows for {t} tokens")
        return out.astype(np.float32, copy=False)

    def _prefill_binding(
        self, slot: int, tokens: Sequence[int], start: int, logits_rows: int | None
    ) -> ort.IOBinding:
        """The binding of one slot's prompt chunk at positions ``start..`` (inputs bound)."""
        t = len(tokens)
        if t == 0 or start + t > self.context:
            raise ValueError(f"prefill of {t} tokens at {start} exceeds context {self.context}")
        ids = np.asarray(tokens, np.int64).reshape(1, t)
        mask = np.ones((1, start + t), np.int64)
        positions = np.arange(start, start + t, dtype=np.int64).reshape(1, t)
        if self.info.attention == "gqa":
            io = self._gqa_binding(slot, 1, "prefill")
        else:
            io = self._concat_binding(slot, start, t)
        self._bind_step(io, ids, mask, positions, logits_rows)
        return io

    def decode(
        self, tokens: np.ndarray, lengths: np.ndarray, active: np.ndarray, first: int = 0
    ) -> np.ndarray:
        """One token for each row ``b`` (slot ``first + b``) at position ``lengths[b]``.

        ``tokens``, ``lengths`` and ``active`` have one entry per row, for slots
        ``first..first+B-1``.
        Inactive rows are dummies (gqa) or skipped (concat); their logits are meaningless.
        Returns logits ``[B, vocab]`` (a view, valid until the next call).
        """
        rows = len(tokens)
        # inactive rows too: each writes one position
        total = (int(lengths[0]) if rows == 1 else int(lengths.max())) + 1
        if total > self.context:
            raise ValueError("decode past the context")
        if self.info.attention == "concat":
            return self._decode_concat(tokens, lengths, active, first)
        io = self._gqa_binding(first, rows, "decode")
        self._ids[:rows, 0] = tokens
        self._pos[:rows, 0] = lengths
        if rows > 1:  # rewrite the rows' masks in place, under the cached OrtValue's view
            mask = self._mask[: rows * total].reshape(rows, total)
            np.less_equal(self._arange[:total], lengths[:, None], out=mask, casting="unsafe")
        mask_value = self._mask_values.get((rows, total))
        if mask_value is None:
            src = self._ones[:total] if rows == 1 else self._mask[: rows * total]
            mask_value = ort.OrtValue.ortvalue_from_numpy(src.reshape(rows, total))
            self._mask_values[(rows, total)] = mask_value
        c_io = getattr(io, "_iobinding", None) if self._c_session is not None else None
        if c_io is not None:  # the pybind objects: no per-call checks (see the module doc)
            c_io.bind_ortvalue_input("attention_mask", mask_value._ortvalue)
            self._c_session.run_with_iobinding(c_io, None)
        else:
            io.bind_ortvalue_input("attention_mask", mask_value)
            self.session.run_with_iobinding(io)
        return self._logits_of(io, rows, preallocated=bool(self.vocab))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions ``0..n-1`` of slot ``src``'s cache into slot ``dst`` (a prefix one
        request holds, given to another that shares it): afterwards ``dst`` holds them as if it
        had prefilled them, and ``src`` is untouched. Requires ``src`` to hold ``n`` positions;
        called between runs (on the thread that runs them)."""
        if src == dst or n <= 0:
            return
        if n > self.context:
            raise ValueError(f"a prefix of {n} positions exceeds context {self.context}")
        if self.info.attention == "gqa":
            for buf in self._kv:
                buf[dst, :, :n, :] = buf[src, :, :n, :]
            return
        old = self._len[src]
        if old < n:
            raise ValueError(f"slot {src} holds {old} positions, not {n}")
        h, d = self.info.num_kv_heads, self.info.head_dim
        from_bufs, to_bufs = self._pp[src][self._cur[src]], self._pp[dst][self._cur[dst]]
        for a, b in zip(from_bufs, to_bufs, strict=True):
            b[: h * n * d].reshape(h, n, d)[:] = a[: h * old * d].reshape(h, old, d)[:, :n]
        self._len[dst] = n

    # --- concat graphs ------------------------------------------------------------------------

    def _layout(self, slot: int, n: int) -> None:
        """Lay the slot's current buffers out as ``[kv_heads, n, head_dim]``, keeping the first
        ``n`` positions (they were written as part of a sequence of ``_len[slot]`` >= n)."""
        old = self._len[slot]
        if old == n:
            return
        if old < n:
            raise ValueError(f"slot {slot} holds {old} positions, not {n}")
        h, d = self.info.num_kv_heads, self.info.head_dim
        if n:
            src, dst = self._pp[slot][self._cur[slot]], self._pp[slot][self._cur[slot] ^ 1]
            for a, b in zip(src, dst, strict=True):
                b[: h * n * d].reshape(h, n, d)[:] = a[: h * old * d].reshape(h, old, d)[:, :n]
            self._cur[slot] ^= 1
        self._len[slot] = n

    def _concat_binding(self, slot: int, start: int, t: int) -> ort.IOBinding:
        self._layout(slot, start)
        self._len[slot] = start + t  # what the run writes (the buffers swap after it)
        io = self.session.io_binding()
        h, d = self.info.num_kv_heads, self.info.head_dim
        src, dst = self._pp[slot][self._cur[slot]], self._pp[slot][self._cur[slot] ^ 1]
        for a, b, (past, present) in zip(src, dst, self._names, strict=True):
            io.bind_input(past, "cpu", 0, self.kv_dtype, [1, h, start, d], _ptr(a))
            io.bind_output(present, "cpu", 0, self.kv_dtype, [1, h, start + t, d], _ptr(b))
        return io

    def _decode_concat(
        self, tokens: np.ndarray, lengths: np.ndarray, active: np.ndarray, first: int
    ) -> np.ndarray:
        rows = np.flatnonzero(active)
        if len(rows) == 1:  # one slot: a one-token prefill, no gather
            row = int(rows[0])
            logits = self.prefill(first + row, [int(tokens[row])], int(lengths[row]))[None, :]
        elif len(rows) > 1:
            logits = self._decode_concat_batch(rows + first, tokens[rows], lengths[rows])
        else:
            return np.zeros((len(tokens), self.vocab or 1), np.float32)
        out = np.zeros((len(tokens), logits.shape[1]), np.float32)
        out[rows] = logits
        return out

    def _batch_buffers(self, size_past: int, size_present: int) -> None:
        if not self._batch_past or self._batch_past[0].size < size_past:
            self._batch_past = [np.zeros(size_past, self.kv_dtype) for _ in self._names]
        if not self._batch_present or self._batch_present[0].size < size_present:
            self._batch_present = [np.zeros(size_present, self.kv_dtype) for _ in self._names]

    def _decode_concat_batch(
        self, slots: np.ndarray, tokens: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray:
        """One token for each of ``slots`` (all decoding) in one run; logits ``[B, vocab]``."""
        b, h, d = len(slots), self.info.num_kv_heads, self.info.head_dim
        p = int(lengths.max())
        for slot, n in zip(slots, lengths, strict=True):
            self._layout(int(slot), int(n))
        self._batch_buffers(b * h * p * d, b * h * (p + 1) * d)
        io = self.session.io_binding()
        for i, (past, present) in enumerate(self._names):
            src = self._batch_past[i][: b * h * p * d].reshape(b, h, p, d)
            for r, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
                own = self._pp[slot][self._cur[slot]][i][: h * n * d].reshape(h, n, d)
                src[r, :, :n] = own
                src[r, :, n:] = 0  # masked out, but never NaN garbage under a zero weight
            dst = self._batch_present[i]
            io.bind_input(past, "cpu", 0, self.kv_dtype, [b, h, p, d], _ptr(src))
            io.bind_output(present, "cpu", 0, self.kv_dtype, [b, h, p + 1, d], _ptr(dst))
        ids = np.ascontiguousarray(tokens, np.int64).reshape(b, 1)
        mask = np.zeros((b, p + 1), np.int64)
        mask[:, p] = 1
        mask[:, :p] = np.arange(p)[None, :] < lengths[:, None]
        positions = np.ascontiguousarray(lengths, np.int64).reshape(b, 1)
        self._bind_step(io, ids, mask, positions, b)
        logits = self._run(io, b)
        for i in range(len(self._names)):
            new = self._batch_present[i][: b * h * (p + 1) * d].reshape(b, h, p + 1, d)
            for r, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
                nxt = self._pp[slot][self._cur[slot] ^ 1][i][: h * (n + 1) * d].reshape(h, n + 1, d)
                nxt[:, :n] = new[r, :, :n]
                nxt[:, n] = new[r, :, p]
        for slot, n in zip(slots, lengths, strict=True):
            self._cur[slot] ^= 1
            self._len[slot] = int(n) + 1
        return logits
