"""A step's results per sequence: :class:`SeqOutput`, and :func:`commit_tokens`, which commits
a collected batch to its sequences.

Committing marks each item's KV written (``Scheduler.commit``: newly full blocks go to the
prefix cache), then appends each sampled token to its sequence, advancing its grammar and
hashing each block it fills. A stop token ends a sequence with ``FinishReason.STOP`` and is
*not* part of its output (as in ``cloud_engine.model.dense.generate``); a sequence that reaches
its ``max_output`` ends with ``FinishReason.LENGTH``. The sequences that end are returned, not
retired: the caller takes them out of the scheduler and the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloud_engine.scheduler import ScheduledBatch, Scheduler
from cloud_engine.sequence import Sequence
from routing.engine import FinishReason, TokenLogprob


@dataclass(slots=True)
class SeqOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, where the request asks


def commit_tokens(
    batch: ScheduledBatch,
    sampled: list[int],
    lps: list[TokenLogprob | None] | None,
    scheduler: Scheduler,
    seed: int,
) -> tuple[list[SeqOutput], list[Sequence]]:
    """Commit ``batch`` and its sampled tokens (one per sampling item, in batch order; ``lps``
    their logprobs or None): the outputs, and the sequences that finished (``seed``: the
    model's, for block hashes)."""
    outputs: list[SeqOutput] = []
    finished: list[Sequence] = []
    k = 0
    bs = scheduler.blocks.block_size
    for it in batch.items:
        seq = it.seq
        scheduler.commit(it)
        if not it.samples:
            continue
        tok = sampled[k]
        lp = lps[k] if lps is not None else None
        k += 1
        sp = seq.sampling
        if not sp.ignore_eos and tok in sp.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
            outputs.append(SeqOutput(seq, [], FinishReason.STOP))
            finished.append(seq)
            continue
        seq.token_ids.append(tok)
        if seq.grammar is not None:
            seq.grammar.advance(tok)
        if seq.num_tokens % bs == 0:
            seq.extend_hashes(seed, bs)
        if seq.num_output >= seq.max_output:
            seq.finish_reason = FinishReason.LENGTH
            finished.append(seq)
        outputs.append(SeqOutput(seq, [tok], seq.finish_reason, None if lp is None else [lp]))
    return outputs, finished
