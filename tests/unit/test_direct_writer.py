"""``durable.tasks.direct.DirectWriter`` against the other end of a real socket pair, the test
playing Redis: what the callers write, the replies the publisher's thread reads, and what
comes back to be published through kombu when Redis refuses or the connection fails.
(tests/integration/test_publisher.py runs it against the real Redis.)"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis

from durable.tasks import direct
from durable.tasks.direct import DirectWriter

pytestmark = pytest.mark.skipif(not direct.supported(), reason="direct writes need MSG_DONTWAIT and poll")


class _Connection:
    """What a writer needs of its redis-py connection: to be closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def disconnect(self) -> None:
        self.sock.close()


@pytest.fixture
def pair() -> Iterator[tuple[DirectWriter, socket.socket, list[str]]]:
    """A writer, the socket at Redis's end, and the thread's wake-ups (one a burst)."""
    ours, theirs = socket.socketpair()
    wakes: list[str] = []
    writer = DirectWriter(_Connection(ours), ours)
    yield writer, theirs, wakes
    writer.close()
    theirs.close()


def _write(writer: DirectWriter, wakes: list[str], message: str) -> bool:
    return writer.write("queue", f'{{"id": "{message}"}}', message, lambda: wakes.append(message))


def _commands(theirs: socket.socket, count: int) -> list[bytes]:
    """Read ``count`` LPUSH commands at Redis's end: their values."""
    data, values = b"", []
    theirs.settimeout(5)
    while len(values) < count:
        data += theirs.recv(65536)
        while data.count(b"\r\n") >= 7:
            lines = data.split(b"\r\n", 7)
            assert lines[:3] == [b"*3", b"$5", b"LPUSH"]
            values.append(lines[6])
            data = lines[7]
    return values


def test_a_command_is_what_redis_py_sends() -> None:
    packer = redis.Connection()
    for key, value in (("q", "x"), ("prefixed:q\u00e9", '{"a": "\\u00e9"}' * 500)):
        assert direct._lpush(key.encode(), value.encode()) == b"".join(packer.pack_command("LPUSH", key, value))


def test_replies_are_read_in_the_order_written_and_a_burst_wakes_the_thread_once(pair) -> None:
    writer, theirs, wakes = pair
    assert all(_write(writer, wakes, m) for m in ("a", "b", "c"))
    assert _commands(theirs, 3) == [b'{"id": "a"}', b'{"id": "b"}', b'{"id": "c"}']
    assert wakes == ["a"]  # the thread is due to read: the next two do not wake it again
    theirs.sendall(b":1\r\n:2\r\n:3\r\n")
    assert writer.collect(everything=True) == ([], False)
    assert not writer.written and not writer.signalled
    assert _write(writer, wakes, "d") and wakes == ["a", "d"]  # read up: the next one wakes it


def test_without_everything_only_the_replies_already_sent_are_read(pair) -> None:
    writer, theirs, wakes = pair
    for m in ("a", "b", "c"):
        _write(writer, wakes, m)
    theirs.sendall(b":1\r\n:2")  # a reply and a half
    time.sleep(0.05)
    assert writer.collect(everything=False) == ([], True)  # more to read: the thread collects again
    assert list(writer.written) == ["b", "c"] and writer.signalled
    theirs.sendall(b"\r\n:3\r\n")
    assert writer.collect(everything=False) == ([], False)
    assert not writer.written


def test_a_message_redis_refuses_comes_back_and_the_connection_is_kept(pair) -> None:
    writer, theirs, wakes = pair
    for m in ("a", "b"):
        _write(writer, wakes, m)
    theirs.sendall(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n:1\r\n")
    assert writer.collect(everything=True) == (["a"], False)
    assert not writer.broken and _write(writer, wakes, "c")


@pytest.mark.parametrize(
    "reply", [b"+OK\r\n", b">3\r\n", b""], ids=["not LPUSH's reply", "a push message", "the connection closed"]
)
def test_a_reply_that_is_not_lpushs_gives_the_writer_up_and_returns_every_message_not_confirmed(pair, reply) -> None:
    writer, theirs, wakes = pair
    for m in ("a", "b", "c"):
        _write(writer, wakes, m)
    if reply:
        theirs.sendall(b":1\r\n" + reply)
    else:
        theirs.sendall(b":1\r\n")
        theirs.shutdown(socket.SHUT_WR)
    assert writer.collect(everything=True) == (["b", "c"], False)
    assert writer.broken and not writer.written
    assert not _write(writer, wakes, "d")  # the caller hands it to the thread


def test_no_reply_within_the_timeout_gives_the_writer_up(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "REPLY_TIMEOUT", 0.05)
    writer, theirs, wakes = pair
    _write(writer, wakes, "a")
    assert writer.collect(everything=True) == (["a"], False)
    assert writer.broken


def test_a_write_the_socket_cannot_take_at_once_never_waits(pair) -> None:
    writer, theirs, wakes = pair
    writer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    written = 0
    started = time.monotonic()
    while _write(writer, wakes, "x" * 2000):  # Redis reads nothing: the buffers fill up
        written += 1
        assert written < 100_000
    assert time.monotonic() - started < 5
    assert writer.broken and len(writer.written) == written
    # The messages written whole are confirmed if their replies come; the connection is closed after.
    theirs.sendall(b":1\r\n" * written)
    assert writer.collect(everything=True) == ([], False)
    assert writer.sock.fileno() == -1
