"""The live replicas behind one env-server URL, shared by every session a process opens on it.

An env service runs as N Compose replicas or N Swarm fleet tasks (`endpoint_mode: dnsrr`); Docker's DNS
answers its name with one address per healthy replica (a Swarm task is listed once healthy, and dropped
when it dies). Sessions connect to an address, least-loaded first, so they spread evenly (DNS
round-robin does not: a resolver caches one order). The answer is resolved again after a failed
connection and when it is older than `refresh_s`, so a replica Swarm or Compose replaced, or a task
`docker service scale` added, is used by the next sessions that connect, and at an episode boundary a
session moves off a replica that holds 2 or more sessions above the least-loaded one.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse, urlunparse

REFRESH_S = 5.0  # re-resolve at most this often while nothing fails (a dict lookup in between)
QUARANTINE_S = 15.0  # a replica that refused a connection is skipped this long, unless it is the only one


class ResolveError(ConnectionError):
    """The env service's name resolved to no address (a ConnectionError: the session client waits and retries)."""


def resolve(url: str) -> list[str]:
    """All replica base URLs behind `url`'s host name (IPv4, sorted). IP literals come back unchanged."""
    parsed = urlparse(url)
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme in ("https", "wss") else 80)
    if host is None:
        raise ResolveError(f"{url!r} has no host; write e.g. http://env-echo:8000")
    try:
        ipaddress.ip_address(host)
        return [url.rstrip("/")]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ResolveError(f"cannot resolve {host!r} ({exc.strerror})") from None
    ips = sorted({info[4][0] for info in infos}, key=ipaddress.ip_address)
    path = parsed.path.rstrip("/")
    return [urlunparse((parsed.scheme, f"{ip}:{port}", path, "", "", "")) for ip in ips]


def task_name(replica_url: str) -> str:
    """`fleet_env-echo.2` (Swarm task) or `grpo-stack-env-echo-1` (Compose container) from Docker's reverse
    DNS for the replica's address; the address itself where there is no name."""
    host = urlparse(replica_url).hostname or replica_url
    try:
        name = socket.gethostbyaddr(host)[0]
    except (OSError, UnicodeError):
        return host
    name = name.rsplit(".", 1)[0] if "." in name else name  # the network's name
    return re.sub(r"\.[a-z0-9]{25}$", "", name)  # a Swarm task's id


@dataclass
class Replica:
    url: str
    name: str
    sessions: int = 0  # open now, from this process
    opened: int = 0  # sessions this process opened on it since the start
    refused_at: float = float("-inf")


class ReplicaSet:
    """Which replica the next session of this process connects to (thread-safe: TRL resets from threads)."""

    _shared: dict[str, "ReplicaSet"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, url: str, resolver: Callable[[str], list[str]] = resolve, namer: Callable[[str], str] = task_name,
                 refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None) -> None:
        self.url = url
        self._resolver, self._namer, self._refresh_s, self._clock = resolver, namer, refresh_s, clock
        self._log = log or (lambda msg: print(f"[envs] {msg}", flush=True))
        self._lock = threading.Lock()  # the counts; never held across a DNS lookup
        self._resolving = threading.Lock()  # one lookup at a time
        self._replicas: dict[str, Replica] = {}  # every replica a session ever used, live or not
        self._live: list[str] = []
        self._resolved_at = float("-inf")

    @classmethod
    def for_url(cls, url: str) -> "ReplicaSet | None":
        """The process-wide set for an env URL; None where sessions must keep the host name (TLS checks it)."""
        if urlparse(url).scheme in ("https", "wss"):
            return None
        with cls._shared_lock:
            if url not in cls._shared:
                cls._shared[url] = cls(url)
            return cls._shared[url]

    # -- choosing --------------------------------------------------------------------------------
    def acquire(self, avoid: set[str] | frozenset[str] = frozenset()) -> str:
        """The least-loaded live replica (not in `avoid`, not recently refused, if any other is live),
        counted as holding one more session. Raises ResolveError when the name resolves to nothing."""
        live = self._live_now()
        with self._lock:
            now = self._clock()
            fresh = [u for u in live if now - self._replicas[u].refused_at >= QUARANTINE_S]
            choices = [u for u in fresh if u not in avoid] or fresh or live
            url = min(choices, key=lambda u: (self._replicas[u].sessions, self._replicas[u].opened))
            replica = self._replicas[url]
            replica.sessions += 1
            replica.opened += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            if url in self._replicas and self._replicas[url].sessions > 0:
                self._replicas[url].sessions -= 1

    def refused(self, url: str) -> None:
        """A connection to `url` failed: skip it for a while and resolve again before the next choice."""
        with self._lock:
            if url in self._replicas:
                self._replicas[url].refused_at = self._clock()
            self._resolved_at = float("-inf")

    def lost(self) -> None:
        """A session's connection dropped (its replica died, or reaped an idle session): resolve again before
        the next choice, so a dead task's address is not tried (Docker's DNS drops it at once)."""
        with self._lock:
            self._resolved_at = float("-inf")

    def should_move(self, url: str) -> bool:
        """True when a live replica holds 2 or more fewer of this process's sessions than `url` (a task just
        added, or one that replaced a dead task), or `url` is no longer live: worth a fresh session at an
        episode boundary."""
        try:
            live = self._live_now()
        except ResolveError:
            return False  # keep what works; a failed connection will resolve again
        with self._lock:
            if url not in live:
                return True
            least = min(self._replicas[u].sessions for u in live)
            return self._replicas[url].sessions - least >= 2

    # -- reporting -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, tuple[int, int]]:
        """`name (address)` -> (sessions open now, sessions opened since the start), for the run's log."""
        with self._lock:
            return {f"{r.name} ({urlparse(r.url).hostname})": (r.sessions, r.opened)
                    for r in self._replicas.values() if r.opened}

    def describe(self) -> str:
        """`8 sessions over 4 replica(s) (name (address): 2 open, 3 opened, ...)`; a replica that is gone shows 0 open."""
        snap = self.snapshot()
        spread = ", ".join(f"{name}: {now} open, {opened} opened" for name, (now, opened) in snap.items())
        with self._lock:
            live = len(self._live)
        return f"{sum(now for now, _ in snap.values())} sessions over {live} replica(s) ({spread})"

    # -- internals -------------------------------------------------------------------------------
    def _live_now(self) -> list[str]:
        """The live replicas, resolved again (DNS, reverse DNS for names) when the answer is stale, outside the
        counts' lock: rollout threads never queue behind a slow resolver. While one thread resolves, the others
        use the last answer; only with no answer yet do they wait for the lookup."""
        with self._lock:
            if self._fresh_locked():
                return self._live
            last = self._live
        if not self._resolving.acquire(blocking=not last):
            return last
        try:
            with self._lock:  # resolved by another thread while this one waited
                if self._fresh_locked():
                    return self._live
            try:
                live = self._resolver(self.url)
            except ResolveError:
                with self._lock:
                    self._live, self._resolved_at = [], self._clock()
                raise
            with self._lock:
                new = [u for u in live if u not in self._replicas]
            names = {u: self._namer(u) for u in new}
            with self._lock:
                for url in new:
                    self._replicas.setdefault(url, Replica(url, names[url]))
                if self._live and live != self._live:
                    added = [self._replicas[u].name for u in live if u not in self._live]
                    gone = [self._replicas[u].name for u in self._live if u not in live]
                    self._log(f"{self.url}: {len(live)} replica(s) now" + (f"; added {', '.join(added)}" if added else "")
                              + (f"; gone {', '.join(gone)}" if gone else ""))
                self._live, self._resolved_at = live, self._clock()
            if not live:
                raise ResolveError(f"{self.url}: no replica answers")
            return live
        finally:
            self._resolving.release()

    def _fresh_locked(self) -> bool:
        return bool(self._live) and self._clock() - self._resolved_at < self._refresh_s
