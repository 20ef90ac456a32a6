"""``edgecloud chat PROMPT``: stream the reference model's answer to the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gateway.commands.argtypes import nonneg_int, positive_int, probability, temperature


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("chat", help="answer one prompt with the torch reference model, streaming")
    p.add_argument("prompt", help="the user message")
    p.add_argument(
        "--model", default=None, help="store name or HF folder (default: the default model)"
    )
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens to generate")
    p.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 = greedy (default), up to 2"
    )
    p.add_argument(
        "--top-p", type=probability, default=1.0, help="nucleus sampling: keep this much mass"
    )
    p.add_argument(
        "--top-k", type=nonneg_int, default=0, help="keep the k likeliest tokens (0: all)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: all cores, at most 8)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (text, token ids) instead"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.temperature <= 2.0:
        print("error: --temperature must be in [0, 2]", file=sys.stderr)
        return 2
    import torch

    from cloud_engine.model.dense import stream_tokens
    from cloud_engine.model.loader import load_model
    from gateway.node.textstream import TextStreamer
    from routing.engine import FinishReason, SamplingParams
    from routing.model_store import DEFAULT_MODEL, ModelNotFound, resolve
    from routing.prompt import PromptFormatter

    torch.set_num_threads(args.threads or min(8, os.cpu_count() or 1))
    name = args.model or DEFAULT_MODEL
    try:
        info = resolve(name)
    except ModelNotFound:
        if args.model is not None:
            raise
        from cloud_engine.model.pull import pull

        info = pull(name)
    model = load_model(info.path)
    fmt = PromptFormatter.from_folder(info.path)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt_ids = fmt.encode_chat(messages)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=fmt.stop_token_ids,
    )
    streamer = TextStreamer(fmt.tokenizer, args.stop)
    tokens: list[int] = []
    reason = FinishReason.LENGTH
    t0 = time.perf_counter()
    for tok, fin in stream_tokens(model, prompt_ids, params):
        if fin is FinishReason.STOP:
            reason = fin
            break
        tokens.append(tok)
        piece = streamer.push([tok])
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if streamer.stopped:
            reason = FinishReason.STOP
            break
        if fin is not None:
            reason = fin
    tail = streamer.flush()
    elapsed = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps(
                {
                    "model": info.name,
                    "text": streamer.text,
                    "token_ids": tokens,
                    "prompt_tokens": len(prompt_ids),
                    "finish_reason": reason.value,
                    "seconds": round(elapsed, 3),
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write(tail + "\n")
    return 0
