"""What one env server's WebSocket may cost the trainer's shared client loop besides its replies (#63).

An env image may be hostile (SECURITY.md), and frames that are no reply cost the loop every env's sessions share:
  * small frames: control frames (pings, pongs), empty data frames and fragments under SMALL_FRAGMENT_BYTES. A server
    streaming empty pongs held a benign env's step 4.2 s with one session, 35 s with 16: each frame is parsed in
    Python. More than MAX_SMALL_FRAMES_PER_S in a second (a live server sends one ping per ~20 s and a pong per ping
    of ours) aborts the connection at once, mid-read, before the rest of what it sent is parsed;
  * unsent pongs: a pong is queued for every ping, with no backpressure, so a server that floods pings and stops
    reading grew the trainer 1.6 GiB in 100 s with 16 sessions. Past MAX_UNSENT_PONG_BYTES of pongs queued since the
    send buffer was last empty, the connection is aborted (a request of ours may be big and slow to send: not counted).
An aborted connection's `abort_reason` says which, in one line, for the session client's error and its log.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ProtocolError
from websockets.frames import CTRL_OPCODES, Frame, Opcode

MAX_SMALL_FRAMES_PER_S = 64
SMALL_FRAGMENT_BYTES = 4096  # a real server sends a message as one frame, or in fragments of kilobytes
MAX_UNSENT_PONG_BYTES = 256 << 10  # ~2,000 pongs: a live server reads each one as it comes


def is_small(frame: Frame) -> bool:
    """A frame that costs its parse and delivers no reply worth it."""
    if frame.opcode in CTRL_OPCODES or not frame.data:
        return True
    fragment = frame.opcode is Opcode.CONT or not frame.fin
    return fragment and len(frame.data) < SMALL_FRAGMENT_BYTES


class BoundedConnection(ClientConnection):
    """websockets' client connection, aborted on a small-frame flood or too many unsent bytes (module docstring)."""

    abort_reason: Optional[str] = None

    def __init__(self, protocol: Any, **kwargs: Any) -> None:
        super().__init__(protocol, **kwargs)
        self._window_ends = 0.0
        self._small_frames = 0
        self._unsent_pongs = 0  # pong bytes queued since the send buffer was last empty
        recv_frame = protocol.recv_frame

        def counted(frame: Frame) -> None:  # the parser's one call per frame: a flood stops mid-read
            if is_small(frame) and self._flooded():
                raise ProtocolError(self.abort_reason)  # the parser fails the connection and discards the rest
            if frame.opcode is Opcode.PING:
                self._unsent_pongs += len(frame.data) + 6  # its pong: the payload, a header and a mask
            recv_frame(frame)

        protocol.recv_frame = counted

    def _flooded(self) -> bool:
        now = time.monotonic()
        if now >= self._window_ends:
            self._window_ends, self._small_frames = now + 1.0, 0
        self._small_frames += 1
        if self._small_frames > MAX_SMALL_FRAMES_PER_S and self.abort_reason is None:
            self.abort_reason = (f"sent more than {MAX_SMALL_FRAMES_PER_S} control, empty or small frames in a "
                                 "second (a flood); the connection was aborted")
        return self.abort_reason is not None

    def data_received(self, data: bytes) -> None:
        if not self.transport.get_write_buffer_size():
            self._unsent_pongs = 0
        super().data_received(data)
        if self.abort_reason is None and self._unsent_pongs > MAX_UNSENT_PONG_BYTES:
            self.abort_reason = (f"left more than {MAX_UNSENT_PONG_BYTES:,} bytes of pongs unsent (it sends pings and "
                                 "does not read the answers); the connection was aborted")
        if self.abort_reason is not None:
            self.transport.abort()
