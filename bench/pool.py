"""The parent's handle on the benchmark processes (see ``bench.worker``)."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import queue
from collections.abc import Iterable, Sequence
from typing import Any

from bench import worker


class WorkerError(Exception):
    """A benchmark process failed a command, died, or did not answer in time."""


class WorkerPool:
    """``size`` spawned processes, each with its own command queue; one shared reply queue.

    ``barrier_sizes``: how many processes take part in a timed command (one
    barrier each, used by processes ``0 .. n-1``).
    """

    def __init__(self, size: int, config: dict[str, Any], barrier_sizes: Iterable[int], *, timeout: float = 300) -> None:
        ctx = multiprocessing.get_context("spawn")
        sizes = sorted({n for n in barrier_sizes if 0 < n <= size} | {1})
        self._barriers = [ctx.Barrier(n) for n in sizes]
        self._results: Any = ctx.Queue()
        self._commands: list[Any] = [ctx.Queue() for _ in range(size)]
        self._ids = itertools.count(1)
        self._procs = [
            ctx.Process(
                target=worker.serve,
                args=(i, json.dumps(config), sizes, self._barriers, self._commands[i], self._results),
                name=f"durable-bench-{i}",
                daemon=True,
            )
            for i in range(size)
        ]
        try:
            for proc in self._procs:
                proc.start()
            self._collect(0, size, timeout)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._procs)

    def call(self, workers: Sequence[int], message: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Send ``message`` to ``workers``; return their replies, raising ``WorkerError`` on any error."""
        replies = self.call_lenient(workers, message, timeout)
        for reply in replies:
            if "error" in reply:
                raise WorkerError(f"benchmark process {reply['worker']} failed {message['cmd']}:\n{reply['error']}")
        return replies

    def call_lenient(self, workers: Sequence[int], message: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Like ``call``, but replies carrying ``error`` are returned, not raised."""
        request_id = next(self._ids)
        payload = json.dumps({**message, "id": request_id})
        for w in workers:
            self._commands[w].put(payload)
        return self._collect(request_id, len(workers), timeout)

    def _collect(self, request_id: int, expected: int, timeout: float) -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = []
        while len(replies) < expected:
            try:
                reply = json.loads(self._results.get(timeout=timeout))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                raise WorkerError(
                    f"{expected - len(replies)} benchmark process(es) did not answer within {timeout:.0f}s"
                    + (f" (dead: {', '.join(dead)})" if dead else "")
                ) from None
            if reply.get("id") == request_id:
                replies.append(reply)
                if "error" in reply:
                    if request_id == 0:
                        raise WorkerError(f"benchmark process {reply['worker']} could not start:\n{reply['error']}")
                    # Release the others from the barrier the failed process will never reach.
                    self.reset_barriers()
        return sorted(replies, key=lambda r: int(r["worker"]))

    def reset_barriers(self) -> None:
        """Make the barriers usable again after a command failed half-way."""
        for barrier in self._barriers:
            barrier.reset()

    def close(self) -> None:
        """Stop every process: politely, then by terminate() for any still running."""
        stop = json.dumps({"cmd": "stop", "id": -1})
        for proc, commands in zip(self._procs, self._commands, strict=False):
            if proc.is_alive():
                commands.put(stop)
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(timeout=15)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)
        self._results.close()
        for commands in self._commands:
            commands.close()
