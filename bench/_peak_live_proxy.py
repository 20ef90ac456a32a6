"""A user-space TCP proxy that adds a fixed round trip: every byte each way is held
``rtt_ms / 2`` before it is passed on (order kept, nothing merged or split beyond what TCP
does), so a request through it sees the round trip of a link ``rtt_ms`` long, on its first
byte and on every streamed token.

    python -m bench._peak_live_proxy LISTEN_PORT:TARGET_PORT:RTT_MS [...]

One process serves every route given; it prints ``proxy ready`` once all listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Route:
    """Listen on 127.0.0.1:``listen``, forward to 127.0.0.1:``target``, adding ``rtt_ms``."""

    listen: int
    target: int
    rtt_ms: float

    @classmethod
    def parse(cls, text: str) -> Route:
        listen, target, rtt = text.split(":")
        return cls(int(listen), int(target), float(rtt))

    def arg(self) -> str:
        return f"{self.listen}:{self.target}:{self.rtt_ms:g}"


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``src`` to ``dst``, each chunk written ``delay_s`` after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def writer() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            dst.write(data)
            await dst.drain()

    task = asyncio.create_task(writer())
    try:
        while data := await src.read(65536):
            queue.put_nowait((time.perf_counter() + delay_s, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError, OSError):
            await task
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()


async def _handle(route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", route.target)
    except OSError:
        writer.close()
        return
    one_way = route.rtt_ms / 2000.0
    try:
        await asyncio.gather(_pipe(reader, up_w, one_way), _pipe(up_r, writer, one_way))
    finally:
        for w in (up_w, writer):
            w.close()


async def start(routes: list[Route]) -> list[asyncio.Server]:
    """Listen on every route; the servers (close them to stop)."""
    servers = []
    for route in routes:

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, rt: Route = route):
            await _handle(rt, r, w)

        servers.append(await asyncio.start_server(handle, "127.0.0.1", route.listen, backlog=4096))
    return servers


async def _main(routes: list[Route]) -> None:
    servers = await start(routes)
    print("proxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(_main([Route.parse(a) for a in sys.argv[1:]]))
