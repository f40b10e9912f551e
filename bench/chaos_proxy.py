"""A TCP proxy between the trainer and the env replicas that can drop, half-open and delay connections (bench/chaos.py).

One listening address on 127.0.0.1; each connection goes to the live replica with the fewest connections (a replica
that refuses is skipped, as Docker's DNS drops a dead one). Faults, asked from any thread:
  * drop(): one live connection reset on both sides (RST: SO_LINGER 0), as a crashed NAT or a pulled cable does;
  * half_open(): one live connection frozen: nothing more is forwarded either way and the proxy never closes the
    replica's side, so the server holds a session whose client is gone (OpenEnv #1000) until its own keepalive or
    idle reaping notices; the client's side sees silence until its own bound fires;
  * delay(seconds, for_s): every reply chunk waits `seconds` before it is forwarded, for `for_s` (a slow tail);
  * hostile_frames(kind): one live WebSocket link gets bursts of empty control frames from the "server" (`pong`: an
    unsolicited pong stream; `ping`: a ping flood the client must answer), written only between the server's own
    frames, for HOSTILE_FOR_S or until the trainer's side closes the link (#63: a hostile env image; the client must
    end such a session, an infra failure, rather than serve it).
Loopback only: it listens on 127.0.0.1 and connects to the replicas' 127.0.0.1 ports. On a Swarm fleet (whose
overlay the host cannot route to) it runs in a container on the fleet's network, `python bench/chaos_proxy.py
--backends tasks.env-echo:8000`, resolving the tasks for each connection, with its port and a control port published
on 127.0.0.1; the injector sends it one command per line on the control port (RemoteProxy in bench/chaos.py), after
a token only the injector knows (the port is reachable from the env network too).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import os
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Link:
    id: int
    backend: tuple[str, int]
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    opened: float = field(default_factory=time.monotonic)
    frozen_at: float | None = None  # wall clock (time.time), as the injector's log
    client_gone_at: float | None = None  # a frozen link: when the trainer's side gave up on it
    pending_since: float | None = None  # wall clock: a request went up and no reply came down since
    waits: list = field(default_factory=list)  # (from, to) wall clock: each wait for a reply longer than WAIT_S
    cursor: "FrameCursor" = field(default_factory=lambda: FrameCursor())  # where the reply stream is (its frames)
    flooded_until: float = 0.0  # monotonic: hostile frames flow; the client's pongs to them are not requests
    client_closed_at: float | None = None  # wall clock: the trainer's side closed a live link (EOF or reset) ...
    server_closed_at: float | None = None  # ... the server's side did (whichever came first ended the link)
    peer: str | None = None  # the trainer's side as HOST:PORT: its session client's `stalled:` lines name it

    @property
    def waited(self) -> bool:
        """A request went through it and its reply came late or never (pings and pongs are not requests); a frozen
        link: since it froze (a slow reply before, in a delay fault, is not this stall's)."""
        since = self.frozen_at or 0.0
        return self.pending_since is not None or any(end > since for _, end in self.waits)


class FrameCursor:
    """Where a server-to-client byte stream is: in the HTTP response's head, then (after a 101) between or inside
    WebSocket frames. A frame can be injected only `at_boundary` (a control frame may sit between a message's
    fragments, never inside a frame)."""

    def __init__(self) -> None:
        self.head = b""
        self.websocket: bool | None = None  # None: the head is not complete yet; False: not an upgrade
        self.header = b""  # a frame header seen in part
        self.need = 0  # the current frame's bytes still to come

    @property
    def at_boundary(self) -> bool:
        return self.websocket is True and self.need == 0 and not self.header

    def feed(self, data: bytes) -> None:
        if self.websocket is None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                self.head = self.head[-65536:]
                return
            self.websocket = self.head.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"101"]
            data, self.head = self.head[end + 4:], b""
        if not self.websocket:
            return
        i = 0
        while i < len(data):
            if self.need:
                taken = min(self.need, len(data) - i)
                self.need -= taken
                i += taken
                continue
            size = _header_size(self.header)  # None until its first two bytes are known
            while i < len(data) and (size is None or len(self.header) < size):
                self.header += data[i:i + 1]
                i += 1
                size = _header_size(self.header)
            if size is not None and len(self.header) == size:
                self.need, self.header = _payload_length(self.header), b""


def _header_size(header: bytes) -> int | None:
    if len(header) < 2:
        return None
    n = header[1] & 0x7F
    return 2 + {126: 2, 127: 8}.get(n, 0) + (4 if header[1] & 0x80 else 0)


def _payload_length(header: bytes) -> int:
    n = header[1] & 0x7F
    return int.from_bytes(header[2:4] if n == 126 else header[2:10], "big") if n >= 126 else n


HOSTILE_FRAMES = {"pong": b"\x8a\x00", "ping": b"\x89\x00"}  # empty, unmasked (a server's), FIN set
HOSTILE_BURST = 500  # frames per burst (1 KB): far past any sane rate of control frames
HOSTILE_EVERY_S = 0.1
HOSTILE_FOR_S = 5.0


WAIT_S = 1.0  # a reply later than this: the trainer waited on the server (a stall it may have to say)
REQUEST_BYTES = 16  # a WebSocket frame from the client bigger than a ping/pong/close: a request


class ChaosProxy:
    sees_trainer_ports = True  # the trainer connects to it directly: a link's peer is the trainer's own socket

    def __init__(self, backends, seed: int = 0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.backends = backends  # [(host, port)], or a function giving them now (a fleet's tasks)
        self.host, self.listen_port = host, port
        self.random = random.Random(seed)
        self.links: dict[int, Link] = {}
        self.history: list[Link] = []  # every link opened, for `waited`
        self.frozen: list[Link] = []
        self.delay_s = 0.0
        self.delay_until = 0.0
        self.refused = 0
        self.opened = 0
        self._ids = itertools.count(1)
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name="chaos-proxy", daemon=True).start()
        ready.wait()

    # -- faults (any thread) -----------------------------------------------------------------------
    def drop(self) -> dict | None:
        return self._call(self._drop)

    def half_open(self) -> dict | None:
        return self._call(self._half_open)

    def hostile_frames(self, kind: str) -> dict | None:
        return self._call(lambda: self._hostile(kind))

    def link_ends(self, link_id: int) -> dict | None:
        """When each side closed link `link_id` ({"client": wall time or None, "server": ...}; None: no such link)."""
        link = next((link for link in self.history if link.id == link_id), None)
        return None if link is None else {"client": link.client_closed_at, "server": link.server_closed_at}

    def frozen_link(self, link_id: int) -> Link | None:
        return next((link for link in self.frozen if link.id == link_id), None)

    def delay(self, seconds: float, for_s: float) -> None:
        self.delay_s, self.delay_until = seconds, time.monotonic() + for_s

    def waited(self, backend: tuple[str, int] | None, start: float, end: float) -> list[str]:
        """The links on which the trainer waited (over WAIT_S) on a reply from `backend` (None: any) between `start`
        and `end` (wall clock), by their trainer's side (HOST:PORT, "?" unknown); empty: a stopped server nobody
        waited on stalled nothing, and there is nothing to diagnose."""
        out = []
        for link in list(self.history):
            if backend is not None and link.backend != backend:
                continue
            still = link.pending_since is not None and link.pending_since < end  # a frozen link included
            if still or any(a < end and b > start for a, b in link.waits):
                out.append(link.peer or "?")
        return out

    def close(self) -> None:
        """Stop accepting; frozen links stay as they are (the servers must free them by themselves)."""
        self._call(self._stop)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    # -- internals (the proxy's loop) ---------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(asyncio.start_server(self._accept, self.host, self.listen_port))
        ready.set()
        self.loop.run_forever()

    def _call(self, fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def _stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def _live(self) -> list[Link]:
        return [link for link in self.links.values() if link.frozen_at is None]

    def _drop(self) -> dict | None:
        live = self._live()
        if not live:
            return None
        link = self.random.choice(live)
        for writer in (link.client, link.server):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self.links.pop(link.id, None)
        return {"link": link.id, "backend": link.backend[1], "client": link.peer}

    def _half_open(self) -> dict | None:
        live = self._live()
        if not live:
            return None
        link = self.random.choice(live)
        link.frozen_at = time.time()
        self.frozen.append(link)
        return {"link": link.id, "backend": link.backend[1], "client": link.peer}

    def _hostile(self, kind: str) -> dict | None:
        live = [link for link in self._live() if link.cursor.websocket and link.client_closed_at is None
                and link.server_closed_at is None]
        if not live:
            return None
        link = self.random.choice(live)
        link.flooded_until = time.monotonic() + HOSTILE_FOR_S + 1
        self.loop.create_task(self._flood(link, HOSTILE_FRAMES[kind] * HOSTILE_BURST))
        return {"link": link.id, "backend": link.backend[1], "frames": kind, "client": link.peer}

    async def _flood(self, link: Link, burst: bytes) -> None:
        """Bursts between the server's frames (the pump writes whole chunks on this loop: between two of its writes
        the cursor says where the stream is) until HOSTILE_FOR_S or the trainer's side closed the link."""
        deadline = time.monotonic() + HOSTILE_FOR_S
        while time.monotonic() < deadline and link.client_closed_at is link.server_closed_at is None \
                and link.frozen_at is None and not link.client.is_closing():
            if link.cursor.at_boundary:
                link.client.write(burst)
                link.cursor.feed(burst)
            await asyncio.sleep(HOSTILE_EVERY_S)

    def current_backends(self) -> list[tuple[str, int]]:
        return list(self.backends()) if callable(self.backends) else list(self.backends)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            backends = self.current_backends()
        except OSError:
            backends = []
        load = {b: 0 for b in backends}
        for link in self.links.values():
            load[link.backend] = load.get(link.backend, 0) + 1
        order = sorted(backends, key=lambda b: (load[b], self.random.random()))
        for backend in order:
            try:
                server_r, server_w = await asyncio.wait_for(asyncio.open_connection(*backend), 3)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        else:
            self.refused += 1
            client_w.transport.abort()
            return
        self.opened += 1
        peer = client_w.get_extra_info("peername")
        link = Link(next(self._ids), backend, client_w, server_w, peer=f"{peer[0]}:{peer[1]}" if peer else None)
        self.links[link.id] = link
        self.history.append(link)
        await asyncio.gather(self._pump(link, client_r, server_w, to_client=False),
                             self._pump(link, server_r, client_w, to_client=True), return_exceptions=True)
        if link.frozen_at is None:
            self.links.pop(link.id, None)

    async def _pump(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    to_client: bool) -> None:
        try:
            while True:
                try:
                    data = await reader.read(65536)
                except (OSError, asyncio.IncompleteReadError):
                    if link.frozen_at is None:
                        _closed_from(link, to_client)
                    raise
                now = time.time()
                if to_client and data and link.pending_since is not None and link.frozen_at is None:
                    if now - link.pending_since > WAIT_S:
                        link.waits.append((link.pending_since, now))
                    link.pending_since = None
                elif not to_client and len(data) > REQUEST_BYTES and link.pending_since is None \
                        and time.monotonic() > link.flooded_until:  # pongs to a ping flood are not requests
                    link.pending_since = now
                if link.frozen_at is not None:
                    if not data and not to_client:
                        link.client_gone_at = time.time()  # the trainer gave up on it; the server is not told
                        _end_wait(link)
                        return
                    if not data:
                        return
                    continue  # frozen: swallowed either way
                if not data:
                    _closed_from(link, to_client)
                    break
                if to_client and self.delay_s and time.monotonic() < self.delay_until:
                    await asyncio.sleep(self.delay_s)
                if to_client:
                    link.cursor.feed(data)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        if link.frozen_at is None:
            _end_wait(link)  # the link closed: nobody waits on it any more
            try:
                writer.close()
            except OSError:
                pass


def _closed_from(link: Link, server_side: bool) -> None:
    """The side a pump reads from ended (EOF or reset): the server's for the reply pump, else the trainer's."""
    if server_side:
        link.server_closed_at = link.server_closed_at or time.time()
    else:
        link.client_closed_at = link.client_closed_at or time.time()


def _end_wait(link: Link) -> None:
    if link.pending_since is not None:
        now = time.time()
        if now - link.pending_since > WAIT_S:
            link.waits.append((link.pending_since, now))
        link.pending_since = None


# ---------------------------------------------------------------------------- in a container on a fleet's network
def tasks_of(name: str, port: int):
    def resolve() -> list[tuple[str, int]]:
        return sorted((ip, port) for ip in set(socket.gethostbyname_ex(name)[2]))
    return resolve


def sessions_held(backends: list[tuple[str, int]]) -> dict[str, int]:
    import urllib.request

    out = {}
    for host, port in backends:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=3) as r:
                out[f"{host}:{port}"] = json.loads(r.read()).get("active_sessions", -1)
        except (OSError, ValueError):
            out[f"{host}:{port}"] = -1
    return out


CONTROL_TOKEN_ENV = "CHAOS_CONTROL_TOKEN"


def serve_control(proxy: ChaosProxy, port: int, token: str, host: str = "0.0.0.0") -> None:
    """One command per line, one JSON answer per line: drop | half_open | delay S FOR_S | hostile ping|pong |
    frozen ID | ends ID | close | held | waited START END. The first line must be `token TOKEN`: in a container the port
    listens on the env network too (Docker publishes it to 127.0.0.1 from there), where any env image could send
    `delay 1e9 1e9` (#44)."""
    if not token:
        raise SystemExit(f"{CONTROL_TOKEN_ENV} is empty: the control port needs a token (bench/chaos.py sets one)")

    def answer(line: str):
        cmd, *rest = line.split()
        if cmd == "drop":
            return proxy.drop()
        if cmd == "half_open":
            return proxy.half_open()
        if cmd == "delay":
            proxy.delay(float(rest[0]), float(rest[1]))
            return {}
        if cmd == "hostile" and rest and rest[0] in HOSTILE_FRAMES:
            return proxy.hostile_frames(rest[0])
        if cmd == "ends":
            return proxy.link_ends(int(rest[0]))
        if cmd == "frozen":
            link = proxy.frozen_link(int(rest[0]))
            return None if link is None else {"frozen_at": link.frozen_at, "client_gone_at": link.client_gone_at,
                                              "waited": link.waited, "peer": link.peer}
        if cmd == "close":
            proxy.close()
            return {}
        if cmd == "held":
            return sessions_held(proxy.current_backends())
        if cmd == "waited":  # waited START END: on any backend (a fleet's tasks move)
            return proxy.waited(None, float(rest[0]), float(rest[1]))
        return {"error": f"unknown command {cmd}"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = (await reader.readline()).decode(errors="replace").split()
        if len(first) != 2 or first[0] != "token" or not hmac.compare_digest(first[1].encode(), token.encode()):
            writer.write(b'{"error": "the first line must be: token TOKEN"}\n')
            await writer.drain()
            writer.close()
            return
        writer.write(b"{}\n")
        await writer.drain()
        while line := (await reader.readline()).decode().strip():
            reply = await asyncio.to_thread(answer, line)
            writer.write((json.dumps(reply) + "\n").encode())
            await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, host, port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the chaos proxy in a container on a fleet's network")
    p.add_argument("--backends", required=True, help="NAME:PORT resolved for each connection (tasks.env-echo:8000)")
    p.add_argument("--listen", type=int, default=9000)
    p.add_argument("--control", type=int, default=9001)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    name, _, backend_port = a.backends.rpartition(":")
    serve_control(ChaosProxy(tasks_of(name, int(backend_port)), a.seed, "0.0.0.0", a.listen), a.control,
                  os.environ.get(CONTROL_TOKEN_ENV, ""))
