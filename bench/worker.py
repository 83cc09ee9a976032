"""What a benchmark process runs (started with the 'spawn' method by ``bench.pool``).

It sets Django up on the scratch databases, then serves commands from its own
queue until "stop". Commands and replies are JSON strings; nothing else crosses
the process boundary. A command's heavy set-up (connections, warm-up starts) is
its "prepare" step, answered before the parent sends the timed command, which
starts on a barrier shared by the processes taking part.

Commands (``cmd``):

- ``prepare``: open the starter of ``kind`` (dispatch, dispatch_threaded, dispatch_sync,
  dispatch_unbatched, dispatch_kombu, dispatch_prepared, durable, raw, procrastinate, dbos; ``hot`` registers the hot workflow
  with ``limit``; ``latency`` opens durable on each of ``aliases``) and warm it up.
- ``rate``: start runs of ``kind`` round-robin over this process's ``nkeys`` keys
  for ``seconds``; reply the count, the elapsed time and the CPU time used (both
  include the wait for the background publisher's last messages, for dispatch).
- ``storm``: start the hot workflow on ``key`` for ``seconds`` (with ``input_bytes``,
  an input of about that many bytes: ``starters.chat_input``); reply the
  admitted and refused counts and their latencies (microseconds), and the CPU
  time the process and its database backend used (``_CpuMeter``).
- ``roundtrip``: send ``SELECT 1`` for ``seconds`` through ``via`` ("django":
  Django's ``connection.cursor()``, as durable does; "psycopg": a bare psycopg
  connection); reply every call's latency (microseconds) and the CPU time, as
  ``storm``. The floor under any refusal, measured with the same processes.
  ``via`` "statement": the statement a refusal of ``key`` at ``limit`` sends, through
  Django's cursor (``starters.RoundTrip``), which must refuse.
- ``latency``: ``starts`` starts on each alias, alternating between the aliases
  start by start; reply every start's latency (microseconds).
- ``warm``: one start of the no-op workflow on each of ``keys`` (creates their lock rows).
- ``fill``: ``limit`` starts of the ``GROUP_ROUND_ROBIN`` workflow on each of ``keys``
  (``prepare`` of kind ``grr`` registers it), so that every key is at its limit.
- ``admit``: ``counts[i]`` starts (process ``i``) of ``kind`` (``grr``: the
  ``GROUP_ROUND_ROBIN`` workflow; ``reject``: the no-op workflow) round-robin
  over ``keys``; reply the statuses created, the elapsed time and the CPU time.
- ``firststep``: ``warm`` + ``samples`` rounds, each a ``FirstStep.dispatch``, a
  ``probe_write.apply_async`` and the same after a committed INSERT on the caller's
  connection (the ``outbox`` kind), in rotating order, each waited for until its
  body has run in the Celery worker of (f); reply, per kind, the microseconds from
  the call to the body's start (``time.time()`` in both processes), and from the
  call to its return; with ``busy``, the process computes that many seconds after
  each call (as a view renders its response) before it waits for the body.
- ``publishhop``: for each of ``busy`` (seconds), ``warm`` + ``samples``
  ``FirstStep.dispatch`` calls to ``queue``, one at a time, the process computing
  that long after each call; reply each sample's task id and the time its call
  returned (the benchmark's listener on ``queue`` stamps each message's arrival).
- ``drain``: finish the runs in flight on ``keys`` one by one (each claimed first,
  untimed), each finish handing its freed slot to the next queued run
  (``Executor.released``'s promote) until none is left; reply the hand-offs made,
  the time the finishes took and each one's duration.

``keys`` with ``per_process`` set get the process's suffix (``-w<i>``): each
process then has keys of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from bench import starters

Reply = dict[str, Any]
#: What ``firststep`` sends in turn: durable's dispatch, the bare task, the bare task after a committed INSERT.
FIRST_STEP_KINDS = ("dispatch", "baseline", "outbox")


def serve(index: int, databases: str, barrier_sizes: list[int], barriers: list[Any], commands: Any, results: Any) -> None:
    """Entry point of a benchmark process. ``databases``: JSON of alias -> name, plus URLs."""
    config = json.loads(databases)
    try:
        _setup_django(config["aliases"], config["broker"], config["queue"])
        worker = _Worker(index, config, dict(zip(barrier_sizes, barriers, strict=False)))
    except BaseException:
        results.put(json.dumps({"worker": index, "id": 0, "error": traceback.format_exc()}))
        return
    results.put(json.dumps({"worker": index, "id": 0, "ready": os.getpid()}))
    try:
        while True:
            message = json.loads(commands.get())
            if message["cmd"] == "stop":
                break
            try:
                reply = worker.handle(message)
            except Exception:
                reply = {"error": traceback.format_exc()}
            reply.update(worker=index, id=message["id"])
            results.put(json.dumps(reply))
    finally:
        worker.close()


def _setup_django(aliases: dict[str, str], broker: str, queue: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    # Read by the test project's settings: the Celery app's broker, and the queue
    # durable's Celery dispatcher sends runs to.
    os.environ["CELERY_BROKER_URL"] = broker
    os.environ["DURABLE_TASK_QUEUE"] = queue
    import django
    from django.conf import settings

    base: dict[str, Any] = dict(settings.DATABASES["default"])
    for alias, name in aliases.items():
        settings.DATABASES[alias] = {**base, "NAME": name}
    # As in production: DEBUG would also make Django log every query it sends.
    settings.DEBUG = False
    django.setup()


class _Worker:
    def __init__(self, index: int, config: dict[str, Any], barriers: dict[int, Any]) -> None:
        self.index = index
        self.config = config
        self.barriers = barriers
        self.starters: dict[str, Any] = {}
        self.cursors: dict[str, int] = {}

    # -- commands ------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> Reply:
        cmd = message["cmd"]
        if cmd == "prepare":
            return self.prepare(message)
        if cmd == "rate":
            return self.rate(
                message["kind"], float(message["seconds"]), int(message["nkeys"]), int(message["size"]), int(message["round"])
            )
        if cmd == "storm":
            return self.storm(message["key"], float(message["seconds"]), int(message["size"]), int(message.get("input_bytes", 0)))
        if cmd == "roundtrip":
            return self.roundtrip(
                message["via"],
                float(message["seconds"]),
                int(message["size"]),
                message.get("key", ""),
                int(message.get("limit", 0)),
            )
        if cmd == "latency":
            return self.latency(message["aliases"], int(message["starts"]), int(message["nkeys"]))
        if cmd == "warm":
            return self.warm(self._own(message))
        if cmd == "fill":
            return self.fill(self._own(message), int(message["limit"]))
        if cmd == "admit":
            count = int(message["counts"][self.index])
            return self.admit(message["kind"], self._own(message), count, int(message["size"]))
        if cmd == "drain":
            return self.drain(self._own(message))
        if cmd == "firststep":
            return self.first_step(
                int(message["samples"]),
                int(message["warm"]),
                float(message["timeout"]),
                float(message.get("busy", 0.0)),
                bool(message.get("direct", True)),
            )
        if cmd == "publishhop":
            rows = [(float(seconds), bool(direct)) for seconds, direct in message["rows"]]
            return self.publish_hop(str(message["queue"]), int(message["samples"]), int(message["warm"]), rows)
        raise ValueError(f"unknown command {cmd!r}")

    def prepare(self, message: dict[str, Any]) -> Reply:
        kind = message["kind"]
        if kind == "hot":
            durable = self._starter("durable")
            durable.set_hot_limit(int(message["limit"]))
            return {"ok": True}
        if kind == "grr":
            self._starter("durable").set_grr_limit(int(message["limit"]))
            return {"ok": True}
        if kind == "latency":
            for alias in message["aliases"]:
                starter = self._starter(f"durable@{alias}")
                for j in range(int(message["nkeys"])):
                    starter.start(_latency_key(j))
            return {"ok": True}
        starter = self._starter(kind)
        if kind not in self.cursors:
            self.cursors[kind] = 0
            self._warm(kind, starter, self._keys(kind, int(message["nkeys"]), "warm"))  # the connection
        return {"ok": True}

    def _warm(self, kind: str, starter: Any, keys: list[str]) -> int:
        """One start per key, untimed: creates the keys' lock rows (a one-time cost per
        key) and warms the connection, so the timed runs see steady state. The
        number of starts made (their messages are on the broker once it returns)."""
        warm = keys if kind.startswith("dispatch") or kind in ("durable", "raw") else keys[:20]
        for key in warm:
            starter.start(key)
        if hasattr(starter, "finish"):
            starter.finish()
        return len(warm)

    def rate(self, kind: str, seconds: float, nkeys: int, size: int, round: int) -> Reply:
        """Starts for ``seconds`` on this round's own ``nkeys`` keys, round-robin.

        Nothing executes the runs of (a): they stay in flight, and a quota counts
        its key's runs in flight. Keys reused from round to round would pile up
        every earlier round's runs (hundreds a key by the last round, where a
        user's key holds at most its limit), and each round would time a longer
        count than the one before, for durable (which counts twice a start, before
        and under the lock) and the raw transaction (once), not for the
        libraries that count nothing. So each round starts on new keys (a few
        dozen runs each by its end), warmed before the timed window."""
        starter = self.starters[kind]
        keys = self._keys(kind, nkeys, f"r{round}")
        i = self.cursors[kind]
        count = refused = 0
        if hasattr(starter, "begin"):
            starter.begin()
        try:
            warmed = self._warm(kind, starter, keys)
            self.barriers[size].wait(timeout=120)
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            deadline = t0 + seconds
            while True:
                if not starter.start(keys[i % nkeys]):
                    refused += 1
                i += 1
                count += 1
                if time.perf_counter() >= deadline:
                    break
            if hasattr(starter, "finish"):
                starter.finish()  # in the timed window: the round counts only what reached the broker
            elapsed = time.perf_counter() - t0
        finally:
            if hasattr(starter, "end"):
                starter.end()
        self.cursors[kind] = i
        return {"count": count, "warmed": warmed, "elapsed": elapsed, "refused": refused, "cpu": time.process_time() - cpu0}

    def storm(self, key: str, seconds: float, size: int, input_bytes: int = 0) -> Reply:
        durable = self.starters["durable"]
        admitted: list[int] = []
        refused: list[int] = []
        meter = _CpuMeter(starters.django_backend_pid)
        start = lambda: durable.start(key, workflow=starters.HOT_WORKFLOW, input_bytes=input_bytes)  # noqa: E731
        for ok, us in _timed(start, seconds, self.barriers[size]):
            (admitted if ok else refused).append(us)
        return {"admitted_us": admitted, "refused_us": refused, "cpu": meter.used()}

    def roundtrip(self, via: str, seconds: float, size: int, key: str = "", limit: int = 0) -> Reply:
        if via == "statement":  # its key and limit are this call's: not kept among the starters
            probe = starters.RoundTrip(via, self.config["conninfo"], key=key, limit=limit)
        else:
            probe = self._starter(f"roundtrip@{via}")
        for _ in range(50):
            probe()
        if via == "statement" and probe() is None:
            raise RuntimeError(f"durable_full_key does not refuse a start of {key!r} at limit {limit}: the key is not full")
        meter = _CpuMeter(probe.backend_pid)
        latencies = [us for _, us in _timed(probe, seconds, self.barriers[size])]
        return {"latency_us": latencies, "cpu": meter.used()}

    def latency(self, aliases: list[str], starts: int, nkeys: int) -> Reply:
        """``starts`` timed starts on each alias, alternating start by start (AB BA AB ...)."""
        out: dict[str, list[int]] = {alias: [] for alias in aliases}
        pairs = [(alias, self.starters[f"durable@{alias}"]) for alias in aliases]
        self.barriers[1].wait(timeout=120)
        for i in range(starts):
            key = _latency_key(i % nkeys)
            for alias, starter in pairs if i % 2 == 0 else pairs[::-1]:
                t = time.perf_counter()
                starter.start(key)
                out[alias].append(int((time.perf_counter() - t) * 1e6))
        return {"latency_us": out}

    def warm(self, keys: list[str]) -> Reply:
        durable = self._starter("durable")
        refused = sum(not durable.start(key) for key in keys)
        return {"refused": refused}

    def fill(self, keys: list[str], limit: int) -> Reply:
        durable = self._starter("durable")
        statuses = Counter(durable.start_status(key, starters.GRR_WORKFLOW) for key in keys for _ in range(limit))
        return {"statuses": dict(statuses)}

    def admit(self, kind: str, keys: list[str], count: int, size: int) -> Reply:
        """``count`` starts round-robin over ``keys``, from an offset of this process's own."""
        durable = self._starter("durable")
        workflow = starters.GRR_WORKFLOW if kind == "grr" else starters.WORKFLOW
        offset = self.index * len(keys) // max(size, 1)
        statuses: Counter[str] = Counter()
        self.barriers[size].wait(timeout=120)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for i in range(count):
            statuses[durable.start_status(keys[(offset + i) % len(keys)], workflow)] += 1
        elapsed = time.perf_counter() - t0
        return {"statuses": dict(statuses), "count": count, "elapsed": elapsed, "cpu": time.process_time() - cpu0}

    def drain(self, keys: list[str]) -> Reply:
        """Finish each key's run in flight, key after key, as a worker finishing it would;
        each finish hands the freed slot to the next queued run, until none is left.

        A run in flight is claimed first (untimed), then timed: its finish (the
        compare-and-set of a finishing run) and what ``Executor.released`` does on
        commit (at once: autocommit), the promote of its keys. ``elapsed`` sums
        those timed parts.
        """
        from django.db import connection
        from django.utils import timezone

        from durable import Engine
        from durable.models import WorkflowRun
        from durable.status import RunStatus

        starter = self._starter("durable").engine
        sent: list[str] = []
        engine = Engine(store=starter.store, dispatch=lambda engine, run: sent.append(run.run_id), registry=starter.registry)
        store = engine.store
        runs = WorkflowRun.objects.filter(tags__tag__in=["concurrency:" + key for key in keys])
        in_flight = list(runs.filter(status=RunStatus.PENDING).values_list("run_id", flat=True))
        handoffs = completed = 0
        promote_us: list[int] = []
        calls_us: dict[str, list[int]] = {"durable_end": [], "durable_promote": []}

        def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            t = time.perf_counter()
            try:
                return execute(sql, params, many, context)
            finally:
                for name, times in calls_us.items():
                    if sql.startswith(f"SELECT {name}("):
                        times.append(int((time.perf_counter() - t) * 1e6))

        elapsed = 0.0
        while in_flight:
            next_round: list[str] = []
            for run_id in in_flight:
                claimed = store.claim_journal(run_id, lease="drain", worker="bench", stale_before=timezone.now())
                if claimed is None:
                    continue
                del sent[:]
                t = time.perf_counter()
                with connection.execute_wrapper(timed):
                    engine.executor.finish(claimed[0], "drain", RunStatus.COMPLETED)
                took = time.perf_counter() - t
                elapsed += took
                promote_us.append(int(took * 1e6))
                completed += 1
                handoffs += len(sent)
                next_round.extend(sent)
            in_flight = next_round
        left = runs.filter(status=RunStatus.QUEUED).count()
        return {
            "handoffs": handoffs,
            "completed": completed,
            "elapsed": elapsed,
            "promote_us": promote_us,
            "calls_us": calls_us,
            "queued_left": left,
        }

    def first_step(self, samples: int, warm: int, timeout: float, busy: float = 0.0, direct: bool = True) -> Reply:
        """Dispatch to first step vs apply_async to a bare task's body, and vs the same task sent
        after a committed INSERT on this connection (the outbox kind: what any start that commits
        its run before its message leaves does at least), interleaved, one at a time; also how long
        after each dispatch returned the publisher had the broker's reply to its batch, and how many
        dispatches wrote their message on the caller's thread. ``busy``: seconds this thread
        computes (holding the GIL) right after each call, before it waits for the body.
        ``direct``: False sends every message through the publisher's thread."""
        from bench.firststep import PROBE_TABLE
        from durable.conf import settings as durable_settings
        from durable.tasks import publishing

        if not durable_settings.PUBLISH_IN_BACKGROUND:
            raise RuntimeError("(f) measures the default dispatch: PUBLISH_IN_BACKGROUND is off in this process")

        body_of = {
            "dispatch": "SELECT (output ->> 'started')::float8 FROM durable_workflowrun "
            "WHERE run_id = %s AND status = 'completed'",
            "baseline": f"SELECT started FROM {PROBE_TABLE} WHERE token = %s",
        }
        body_of["outbox"] = body_of["baseline"]
        out: dict[str, list[int]] = {kind: [] for kind in FIRST_STEP_KINDS}
        calls: dict[str, list[int]] = {kind: [] for kind in FIRST_STEP_KINDS}
        publishing.DIRECT_WRITES = direct
        try:
            with _published_at() as (published, written):
                hops, direct_count = self._first_steps(samples, warm, timeout, body_of, out, calls, published, written, busy)
        finally:
            publishing.DIRECT_WRITES = True
        return {"latency_us": out, "call_us": calls, "hop_us": hops, "direct": direct_count}

    def _first_steps(
        self,
        samples: int,
        warm: int,
        timeout: float,
        body_of: dict[str, str],
        out: dict[str, list[int]],
        calls: dict[str, list[int]],
        published: dict[str, float],
        written: set[str],
        busy: float,
    ) -> tuple[list[int], int]:
        import uuid

        from django.db import connection

        from bench.firststep import PROBE_TABLE, FirstStep, probe_write
        from durable.conf import settings as durable_settings

        hops: list[int] = []
        direct = 0
        n = len(FIRST_STEP_KINDS)
        for i in range(warm + samples):
            # Each kind goes first, second and third in turn.
            for kind in FIRST_STEP_KINDS[i % n :] + FIRST_STEP_KINDS[: i % n]:
                t0 = time.time()
                if kind == "dispatch":
                    token = FirstStep.dispatch({"key": f"f-k{i % 10}"}).run_id
                else:
                    token = uuid.uuid4().hex
                    if kind == "outbox":
                        # The row a start commits before its message may leave: one INSERT, autocommit.
                        with connection.cursor() as cursor:
                            cursor.execute(f"INSERT INTO {PROBE_TABLE} (token) VALUES (%s)", [f"{token}-outbox"])
                    # To the queue durable sends runs to (the worker of (f) consumes it).
                    probe_write.apply_async(args=(token,), queue=durable_settings.TASK_QUEUE)
                returned = time.time()
                while time.time() - returned < busy:
                    pass  # as a view rendering its response: Python code, holding the GIL
                # The first sample also waits for the worker to come up.
                deadline = time.monotonic() + (timeout * 4 if i == 0 else timeout)
                while True:
                    with connection.cursor() as cursor:
                        cursor.execute(body_of[kind], [token])
                        row = cursor.fetchone()
                    if row is not None and row[0] is not None:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"(f) the {kind} message {token} was not executed within {timeout:g} s")
                    time.sleep(0.002)
                if i >= warm:
                    out[kind].append(int((float(row[0]) - t0) * 1e6))
                    calls[kind].append(int((returned - t0) * 1e6))
                    if kind == "dispatch" and token in published:
                        hops.append(int((published[token] - returned) * 1e6))
                    direct += kind == "dispatch" and token in written
        return hops, direct

    def publish_hop(self, queue: str, samples: int, warm: int, rows: list[tuple[float, bool]]) -> Reply:
        """For each (busy, direct) of ``rows``: ``warm`` + ``samples`` ``FirstStep.dispatch`` calls,
        one at a time, their messages to ``queue`` (no worker consumes it: the benchmark's listener
        stamps each one's arrival), written by the caller (``direct``) or each sent through the
        publisher's thread; this thread computes ``busy`` seconds (holding the GIL) right after each
        call, then waits for the publisher and for a quiet spell longer than
        ``PUBLISH_BATCH_INTERVAL``, so every message goes at once. Reply, per row (its repr), each
        sample's task id and the time.time() its call returned."""
        from django.conf import settings

        from bench.firststep import FirstStep
        from durable import conf
        from durable.tasks import publisher, publishing, task_id

        if not conf.settings.PUBLISH_IN_BACKGROUND:
            raise RuntimeError("(f) measures the background publisher: PUBLISH_IN_BACKGROUND is off in this process")
        before = getattr(settings, "DURABLE", {})
        settings.DURABLE = {**before, "TASK_QUEUE": queue}
        returned: dict[str, list[tuple[str, float]]] = {}
        try:
            quiet = conf.publish_batch_interval() + 0.003
            for seconds, direct in rows:
                publishing.DIRECT_WRITES = direct
                sent = returned[repr((seconds, direct))] = []
                for i in range(warm + samples):
                    run_id = FirstStep.dispatch({"key": f"hop-k{i % 10}"}).run_id
                    at = time.time()
                    while time.time() - at < seconds:
                        pass  # as a view rendering its response: Python code, holding the GIL
                    if not publisher.flush(30):
                        raise TimeoutError(f"(f) the publisher did not publish run {run_id} within 30 s")
                    time.sleep(quiet)
                    if i >= warm:
                        sent.append((task_id(run_id, 0), at))
        finally:
            settings.DURABLE = before
            publishing.DIRECT_WRITES = True
        return {"returned": returned}

    # -- helpers -------------------------------------------------------------
    def _own(self, message: dict[str, Any]) -> list[str]:
        keys = [str(k) for k in message["keys"]]
        return [f"{k}-w{self.index}" for k in keys] if message.get("per_process") else keys

    def _keys(self, kind: str, nkeys: int, label: str) -> list[str]:
        return [f"{kind}-w{self.index}-{label}-k{j}" for j in range(nkeys)]

    def _starter(self, kind: str) -> Any:
        starter = self.starters.get(kind)
        if starter is None:
            starter = self.starters[kind] = self._open(kind)
        return starter

    def _open(self, kind: str) -> Any:
        if kind == "durable":
            return starters.DurableStarter()
        if kind == "dispatch":
            return starters.DispatchStarter()
        if kind == "dispatch_sync":
            return starters.DispatchStarter(background=False)
        if kind == "dispatch_threaded":
            return starters.DispatchStarter(direct=False)
        if kind == "dispatch_unbatched":
            return starters.DispatchStarter(batch_interval=0, direct=False)
        if kind == "dispatch_kombu":
            return starters.DispatchStarter(templates=False)
        if kind == "dispatch_prepared":
            return starters.DispatchStarter(prepared=True)
        if kind.startswith("durable@"):
            return starters.DurableStarter(using=kind.partition("@")[2])
        if kind.startswith("roundtrip@"):
            return starters.RoundTrip(kind.partition("@")[2], self.config["conninfo"])
        if kind == "raw":
            return starters.RawStarter(self.config["conninfo"])
        if kind == "procrastinate":
            return starters.ProcrastinateStarter(self.config["conninfo"])
        if kind == "dbos":
            return starters.DbosStarter(self.config["dbos_url"])
        raise ValueError(f"unknown starter {kind!r}")

    def close(self) -> None:
        for starter in self.starters.values():
            with contextlib.suppress(Exception):
                starter.close()


@contextlib.contextmanager
def _published_at() -> Iterator[tuple[dict[str, float], set[str]]]:
    """While the block runs: the time.time() at which the background publisher had the broker's
    reply to each run's batch (its pipeline answered), by run id, an upper bound of when the
    message reached the broker, since the thread needs the GIL to read the reply; and the run ids
    whose message the caller's thread wrote itself (a direct write: in Redis as the call returns)."""
    from durable.tasks import publishing

    published: dict[str, float] = {}
    written: set[str] = set()
    publish_batch, write = publishing._publish_batch, publishing._Session.write

    def timed(app: Any, messages: list[Any]) -> None:
        publish_batch(app, messages)
        now = time.time()
        for m in messages:
            published[m.run_id] = now

    def noted(session: Any, m: Any, wake: Any) -> bool:
        done = write(session, m, wake)
        if done:
            written.add(m.run_id)
        return done

    publishing._publish_batch, publishing._Session.write = timed, noted
    try:
        yield published, written
    finally:
        publishing._publish_batch, publishing._Session.write = publish_batch, write


def _timed(call: Callable[[], Any], seconds: float, barrier: Any) -> Iterator[tuple[Any, int]]:
    """Call ``call`` over and over for ``seconds``, from the barrier on; yield each
    result with the call's latency in microseconds."""
    barrier.wait(timeout=120)
    deadline = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        result = call()
        now = time.perf_counter()
        yield result, int((now - t) * 1e6)
        if now >= deadline:
            return


class _CpuMeter:
    """The CPU time this process and its connection's PostgreSQL backend use from
    now to ``used``: {"client": seconds, "database": seconds or None}. The
    backend's is read from /proc, so only when the database runs on this machine
    (and the connection kept the same backend throughout)."""

    def __init__(self, backend_pid: Callable[[], int]) -> None:
        self.backend_pid = backend_pid
        self.pid = backend_pid()
        self.client = time.process_time()
        self.database = _backend_cpu(self.pid)

    def used(self) -> dict[str, float | None]:
        client = time.process_time() - self.client
        database = _backend_cpu(self.pid)
        if self.database is None or database is None or self.backend_pid() != self.pid:
            return {"client": client, "database": None}
        return {"client": client, "database": database - self.database}


def _backend_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` if it is a PostgreSQL backend on this machine."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            name, _, rest = stat.read().rpartition(")")
    except OSError:
        return None
    if not name.endswith("(postgres"):
        return None
    fields = rest.split()  # fields 3, 4, ... of proc(5): utime is the 14th, stime the 15th
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _latency_key(j: int) -> str:
    return f"c-k{j}"
