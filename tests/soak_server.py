"""The engine's own server (engine.serve.create_app) with one injected defect, for the soak and rate-rung tests: it
keeps `--leak-mb` MB a completion request (written, so resident: a memory leak), sleeps `--token-delay-ms` before
each streamed event (a slow server), or kills itself with SIGKILL `--die-after-s` seconds after its first completion
request (a server that dies under load)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading

import uvicorn

from evident.engine.serve import create_app, load_engine

HELD: list[bytearray] = []  # the leak: never freed


class Defect:
    """An ASGI wrapper around the app that injects the defect into every POST."""

    def __init__(self, app, leak_mb: int, delay_s: float, die_after_s: float | None):
        self.app, self.leak_mb, self.delay_s, self.die_after_s = app, leak_mb, delay_s, die_after_s
        self.timer: threading.Timer | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if self.leak_mb:
            HELD.append(bytearray(b"\x01") * (self.leak_mb << 20))
        if self.die_after_s is not None and self.timer is None:
            self.timer = threading.Timer(self.die_after_s, os.kill, (os.getpid(), signal.SIGKILL))
            self.timer.daemon = True
            self.timer.start()

        async def slow(message):
            if self.delay_s and message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(self.delay_s)
            await send(message)

        return await self.app(scope, receive, slow)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--leak-mb", type=int, default=0)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--die-after-s", type=float, default=None)
    a = ap.parse_args()
    app = Defect(create_app(load_engine(a.checkpoint, model_id="defect")), a.leak_mb, a.token_delay_ms / 1e3,
                 a.die_after_s)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
