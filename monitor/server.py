"""The monitor's web page: a small HTTP server on asyncio streams, server-sent events for live data.

Routes: ``/`` the page, ``/static/NAME`` its script and style (from the package, nothing from
a CDN), ``/events`` a stream of snapshots (one every ``every_s``), ``/snapshot`` one snapshot,
``/story?prompt=ID`` (or ``latest``) a prompt's story. Only GET; bound to 127.0.0.1 unless
told otherwise. A snapshot is built once per interval and shared by every open page.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from monitor.live import LiveState
from monitor.story import Storyteller

STATIC = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}


class MonitorServer:
    def __init__(self, state: LiveState, storyteller: Storyteller, every_s: float = 0.5) -> None:
        self.state, self.storyteller, self.every_s = state, storyteller, every_s
        self._snap: tuple[float, bytes] = (0.0, b"")
        self._story_lock = asyncio.Lock()  # tokenizers load once, bridges are not shared between threads
        self.clients = 0

    def snapshot_bytes(self) -> bytes:
        at, data = self._snap
        if time.monotonic() - at >= self.every_s or not data:
            snap = self.state.snapshot()
            snap["clients"] = self.clients
            data = json.dumps(snap, separators=(",", ":")).encode()
            self._snap = (time.monotonic(), data)
        return data

    async def start(self, host: str, port: int) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._handle, host, port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, target = request.split(b" ", 2)[:2]
            if method != b"GET":
                return await _send(writer, 405, "text/plain", b"GET only\n")
            url = urlsplit(target.decode("latin-1"))
            await self._route(url.path, parse_qs(url.query), writer)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass  # a client that went away or spoke nonsense: nothing to answer
        except asyncio.CancelledError:
            pass  # the monitor is stopping (Ctrl-C): asyncio's stream callback would print a cancelled handler
        finally:
            writer.close()

    async def _route(self, path: str, query: dict, writer: asyncio.StreamWriter) -> None:
        if path in ("/", "/index.html"):
            await _send(writer, 200, TYPES[".html"], (STATIC / "index.html").read_bytes())
        elif path.startswith("/static/"):
            file = STATIC / Path(path).name  # the name only: nothing outside the package's folder
            if file.suffix in TYPES and file.is_file():
                await _send(writer, 200, TYPES[file.suffix], file.read_bytes())
            else:
                await _send(writer, 404, "text/plain", b"not found\n")
        elif path == "/snapshot":
            await _send(writer, 200, "application/json", self.snapshot_bytes())
        elif path == "/story":
            await _send(writer, 200, "application/json", await self._story(query.get("prompt", ["latest"])[0]))
        elif path == "/events":
            await self._stream(writer)
        else:
            await _send(writer, 404, "text/plain", b"not found\n")

    async def _story(self, which: str) -> bytes:
        prompts = self.state.prompts
        if which == "latest":
            pid = _latest_complete(self.state)
        else:
            pid = int(which) if which.lstrip("-").isdigit() else None
        if pid is None or pid not in prompts:
            return json.dumps({"error": f"prompt {which}: not among the {len(prompts)} newest prompts seen"}).encode()
        samples = list(prompts[pid])
        async with self._story_lock:
            story = await asyncio.to_thread(self.storyteller.story, pid, samples, list(self.state.models))
        return json.dumps(story).encode()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: keep-alive\r\n\r\n")
        self.clients += 1
        try:
            while True:
                writer.write(b"data: " + self.snapshot_bytes() + b"\n\n")
                await writer.drain()
                await asyncio.sleep(self.every_s)
        finally:
            self.clients -= 1


def _latest_complete(state: LiveState) -> int | None:
    """The newest prompt that every model has samples of (else simply the newest)."""
    models = set(state.models)
    for pid in reversed(state.prompts):
        if {e.model for e, _ in state.prompts[pid]} >= models:
            return pid
    return next(reversed(state.prompts), None)


async def _send(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 "Cache-Control: no-cache\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
