"""Run messages the caller's thread writes to Redis itself, the replies read by the publisher's thread.

Once the background publisher has a verified template for a destination
(``durable.tasks.publishing``), a message costs a few string replacements to render:
less than handing it to the publisher's thread, whose wake-up and turn at the GIL make
the message leave after the commit by up to milliseconds (as long as the caller keeps
the GIL: a view rendering its response, a worker's next statements). So the on-commit
send of a start renders the message and writes its ``LPUSH`` on a connection the
publisher keeps for that (``DirectWriter``), without waiting for the reply: no broker
round trip on the caller's path, and the message is in Redis when the call returns.

The publisher's thread reads the replies (``collect``). A message Redis refused (an
error reply), and every message whose reply could not be read (the connection lost,
no reply within ``REPLY_TIMEOUT``), is published again through kombu by the thread; a
message that reached Redis twice is harmless (the claim is a compare-and-set). A
caller never waits for the socket: a write the socket does not take whole at once
(``MSG_DONTWAIT``) gives the connection up, and that message goes through the thread.

Only where two threads may use one socket, one writing and one reading: a plain TCP
or Unix socket (not TLS: an ``ssl.SSLSocket`` must not be read and written from two
threads at once), on a platform with ``MSG_DONTWAIT``, with real threads (not under
eventlet or gevent). The connection speaks RESP2, whose replies are lines and never
interleaved with push messages.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from kombu.utils.compat import detect_environment

logger = logging.getLogger("durable.tasks")

#: Seconds the publisher's thread waits for the reply to a message written; past that,
#: the connection is given up and the messages not confirmed go through kombu.
REPLY_TIMEOUT = 10.0


class DirectWriter:
    """A connection to the broker's Redis on which callers' threads write ``LPUSH`` commands
    (``write``) and the publisher's thread reads their replies (``collect``), in order."""

    def __init__(self, connection: Any, sock: socket.socket) -> None:
        self.connection, self.sock = connection, sock
        self.lock = threading.Lock()
        #: The messages written whose replies are not read yet, in the order they were written.
        self.written: collections.deque[Any] = collections.deque()
        #: Whether the publisher's thread was woken for what ``written`` holds (and not done with it).
        self.signalled = False
        #: Given up: nothing more is written on it (a failed write, a failed read, ``close``).
        self.broken = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buffer = b""

    @classmethod
    def open(cls, channel: Any) -> DirectWriter | None:
        """A writer on a new connection to the Redis of kombu's ``channel`` (as kombu connects:
        host, database, credentials, timeouts), or None where direct writes are not safe (see
        the module). Raises what connecting raises."""
        pool = getattr(channel, "pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        connection_class = getattr(pool, "connection_class", None)
        if connection_class is None or not isinstance(kwargs, dict) or not supported():
            return None
        kwargs = {name: value for name, value in kwargs.items() if not name.startswith("maint_notifications")}
        connection = connection_class(**dict(kwargs, protocol=2))
        connection.connect()
        sock = getattr(connection, "_sock", None)
        if type(sock) is not socket.socket:  # TLS, or a redis-py that keeps its socket elsewhere
            connection.disconnect()
            return None
        sock.settimeout(None)  # a write never waits (MSG_DONTWAIT); reading waits in poll()
        return cls(connection, sock)

    def write(self, key: str, payload: str, message: Any, wake: Callable[[], None]) -> bool:
        """(A caller's thread.) Write ``LPUSH key payload`` for ``message``; False when it was
        not written (the writer is given up: send the message another way). Wakes the
        publisher's thread (``wake``) when it is not yet due to read replies."""
        data = _lpush(key.encode(), payload.encode())
        with self.lock:
            if self.broken:
                return False
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except OSError:
                sent = 0
            if sent == len(data):
                self.written.append(message)
            else:  # none or part of it: the thread closes the connection, Redis drops the part
                self.broken = True
            if not self.signalled:
                self.signalled = True
                wake()
            return not self.broken

    def collect(self, everything: bool) -> tuple[list[Any], bool]:
        """(The publisher's thread.) Read the replies to the messages written before this call:
        with ``everything``, all of them, waiting for them; else those Redis already sent, waiting
        only when none has come yet (so that a thread reading often reads many at once, and one
        with little to do never spins). Returns the messages to publish again (those Redis refused;
        once the connection failed, every one not confirmed, the writer then closed), and whether
        replies are still to read (then collect again: no caller wakes the thread for those)."""
        with self.lock:
            count = len(self.written)
        again: list[Any] = []
        for read in range(count):
            try:
                reply = self._reply(wait=everything or read == 0)
            except Exception as exc:
                # No message is lost (and Redis closing an idle connection is routine): not a warning.
                logger.info(
                    "durable: the direct connection to the broker failed (%s: %s); its messages not confirmed go through kombu.",
                    type(exc).__name__,
                    exc,
                )
                return again + self.close(), False
            if reply is None:
                break
            message = self.written.popleft()
            if reply.startswith(b"-"):
                logger.debug("durable: the broker refused a message written directly (%r); sent through kombu", reply)
                again.append(message)
        with self.lock:
            broken, more = self.broken, bool(self.written)
            if not more:
                self.signalled = False
        if broken:
            return again + self.close(), False
        return again, more

    def close(self) -> list[Any]:
        """Give the writer up and close its connection; the messages written whose replies were not read."""
        with self.lock:
            self.broken, self.signalled = True, False
            left = list(self.written)
            self.written.clear()
        with contextlib.suppress(Exception):
            self.connection.disconnect()
        return left

    def _reply(self, wait: bool) -> bytes | None:
        """The next reply, a RESP2 line (an integer, ``LPUSH``'s, or an error); None when it has not
        come and ``wait`` is false."""
        while b"\r\n" not in self._buffer:
            if not self._poll.poll(REPLY_TIMEOUT * 1000 if wait else 0):
                if wait:
                    raise TimeoutError(f"no reply within {REPLY_TIMEOUT:g} s")
                return None
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        if line[:1] not in (b":", b"-"):
            raise ConnectionError(f"not a reply to LPUSH: {line[:60]!r}")
        return line


def _lpush(key: bytes, value: bytes) -> bytes:
    """``LPUSH key value`` as RESP writes a command: an array of bulk strings."""
    return b"*3\r\n$5\r\nLPUSH\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(key), key, len(value), value)


def supported() -> bool:
    """Whether this process may write messages directly: ``MSG_DONTWAIT`` and ``poll`` exist, and
    threads are real ones (not eventlet's or gevent's green threads)."""
    return hasattr(socket, "MSG_DONTWAIT") and hasattr(select, "poll") and detect_environment() == "default"
