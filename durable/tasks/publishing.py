"""The background publisher of run messages, and how durable's messages are sent.

``durable.tasks.publisher`` (this module's ``publisher``) publishes the message of a
start, a hand-off or a recovery after the commit, from a thread of the process, in
batches through a producer it keeps (one Redis pipeline a batch with kombu 5.7+), or,
once it has the message's template, lets the committing thread write it to Redis
itself (``durable.tasks.direct``) and reads the reply; the run row is the outbox, so a
message lost here is sent again by the sweeper. The tasks
themselves are in ``durable.tasks.workers``, the dispatcher that hands the messages
over in ``durable.tasks.sending``.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import contextvars
import functools
import itertools
import json
import logging
import math
import os
import queue as _queue_module
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from celery import Celery, signals
from celery.signals import worker_process_shutdown
from celery.utils.saferepr import saferepr
from django.core.signals import setting_changed
from django.dispatch import receiver
from kombu.common import Broadcast, maybe_declare
from kombu.exceptions import OperationalError

from durable import conf
from durable.conf import settings
from durable.tasks.direct import DirectWriter
from durable.tasks.workers import EXECUTE_TASK

logger = logging.getLogger("durable.tasks")  # the package's logger, as documented

#: How ``send_run`` and ``send_wake`` publish: one quick retry (a pooled
#: connection gone stale after a broker restart reconnects), then give up, so a
#: start never hangs on a dead broker (Celery's default retries longer). How long
#: one connection attempt may take is the broker's setting (see the settings reference).
SEND_RETRY_POLICY: dict[str, Any] = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}


def queue_options(queue: str = "") -> dict[str, Any]:
    """The ``queue`` option of a message: ``queue``, else ``TASK_QUEUE``, else none (Celery routes it)."""
    chosen = queue or settings.TASK_QUEUE
    return {"queue": chosen} if chosen else {}


def wants_traceback(exc: BaseException, app: Celery | None = None) -> bool:
    """Whether a failed send deserves a traceback: not for the broker being unreachable."""
    errors: tuple[type[BaseException], ...] = (OperationalError, OSError)
    if app is not None:
        with contextlib.suppress(Exception):
            errors += tuple(app.connection_for_write().connection_errors)
    return not isinstance(exc, errors)


# -- the background publisher ------------------------------------------------------
class _Message(NamedTuple):
    """A run message waiting for the publisher: what ``send_run`` would send, and
    what Celery reads from the caller (its app, the worker task it runs in, and
    the context publish signals run in, when something listens to them)."""

    app: Celery
    run_id: str
    task_id: str
    queue: str | None
    root_id: str | None
    parent_id: str | None
    context: contextvars.Context | None


class _Flush:
    """A marker in the publisher's queue: set once every message put before it is handled."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


#: In the publisher's queue: callers wrote messages directly (``_Session.write``): read the replies
#: ``COLLECT_INTERVAL`` from now.
_WRITTEN = object()

#: Most messages one batch of the publisher takes from its queue before publishing them.
PUBLISH_BATCH = 500

#: After ``IDLE_WAITS`` waits for ``PUBLISH_BATCH_INTERVAL`` in a row that each gathered
#: no other message, this many messages that would wait go at once; the next ones wait
#: again (and so tell whether messages come faster again). A message after a quiet spell
#: ends this at once. One wait that gathers nothing is common when messages come a few
#: milliseconds apart; two in a row are rare, except in a chain.
IDLE_WAITS = 2
AT_ONCE_AFTER_IDLE_WAITS = 16


class Publisher:
    """Publishes the run messages of this process from a background thread.

    ``submit`` (the on-commit callback of a start, on the caller's thread) writes the
    message to Redis itself when its destination has a verified template and the
    thread's session has a direct connection (``_Session.write``,
    ``durable.tasks.direct``: the thread then only reads the reply), unless messages
    come faster than ``DIRECT_WRITES_APART`` (``_Pacing.write_now``); else it puts the
    message on an in-process queue. A daemon thread takes everything waiting
    (at most ``PUBLISH_BATCH``), publishes it through a producer of the Celery
    app's pool that it keeps from batch to batch (``_Session``: in one Redis
    pipeline when kombu offers ``Producer.batch``), and waits for more: no broker
    round trip on the caller's path. Batches are at least
    ``PUBLISH_BATCH_INTERVAL`` apart (5 ms by default): a message that comes sooner
    after the last batch waits for the rest of that interval, with the messages
    that come meanwhile, so a process starting runs fast publishes a few per
    pipeline instead of one (a pipeline and the thread's wake-up cost several
    times what a message adds to it); a message after a quiet spell goes at once.
    ``IDLE_WAITS`` waits in a row that gathered no other message (a chain of
    hand-offs in a worker: each message starts the run whose end sends the next one,
    so waiting only slows the chain down) make the next ``AT_ONCE_AFTER_IDLE_WAITS``
    messages go at once.

    The run row is the outbox: a message that cannot be published (after one
    quick retry, as ``SEND_RETRY_POLICY``) is logged, and the sweeper sends the
    ``pending`` run again after ``REDISPATCH_AFTER``. Nothing is raised into the
    caller. A forked child (prefork workers, ``gunicorn --preload``) starts a
    thread of its own on its first message; the parent's queue stays the
    parent's. The interpreter's exit (and a prefork worker process's) waits up to
    ``exit_timeout`` seconds for the messages still queued.

    The message is the one ``execute_run.apply_async`` sends (Celery's task
    protocol 2, JSON, the task's options, its route), built from Celery's headers
    made once (``app_conf``: ``app.amqp.create_task_message``). On Redis with
    kombu 5.7 or later, once kombu wrote two messages of a destination (its
    route), the next ones are rendered from the text it wrote (``_Template``),
    by the caller (a direct write) or in the batch's pipeline. Celery's
    ``before_task_publish`` and ``after_task_publish`` are sent when they have
    receivers, in a copy of the caller's ``contextvars`` context (tracing
    integrations see the caller's span); ``after_task_publish`` once the batch
    reached the broker. With ``task_send_sent_event`` on, each message goes
    through ``apply_async`` in the thread instead (Celery sends the event).
    """

    #: Seconds the interpreter's exit waits for the messages still queued.
    exit_timeout: float = 5.0

    def __init__(self) -> None:
        self._after_fork()

    def _after_fork(self) -> None:
        """Forget the thread and the queue (of the parent, after a fork): the next message starts anew."""
        self._lock = threading.Lock()
        self._pid = 0
        self._queue: _queue_module.SimpleQueue[_Message | _Flush | object] = _queue_module.SimpleQueue()
        self._pacing = _Pacing()
        self._thread: threading.Thread | None = None

    def submit(self, app: Celery, run_id: str, task_id: str, queue: str | None) -> None:
        """Queue one run's message (never blocks, never raises on the broker's account)."""
        if self._pid != os.getpid():
            self._start()
        parent = app.current_worker_task
        root_id = parent_id = None
        if parent is not None:
            parent_id = parent.request.id
            root_id = parent.request.root_id or parent_id
        listened = signals.before_task_publish.receivers or signals.after_task_publish.receivers
        context = contextvars.copy_context() if listened else None
        m = _Message(app, run_id, task_id, queue, root_id, parent_id, context)
        # The caller writes the message itself when it can, unless messages come faster than
        # DIRECT_WRITES_APART: then the thread's batches cost less CPU than a write each.
        session = _sessions.get(app) if context is None else None
        if session is not None and self._pacing.write_now() and session.write(m, self._written):
            self._pacing.wrote()
            return
        self._queue.put(m)

    def _written(self) -> None:
        """(``DirectWriter.write``) Wake the thread to read the replies to what callers wrote."""
        self._queue.put(_WRITTEN)

    def again(self, messages: list[_Message]) -> None:
        """(The thread.) Publish ``messages`` in a next batch: written directly, not confirmed."""
        for m in messages:
            self._queue.put(m)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message submitted before this call is published (or
        given up and logged); False when ``timeout`` seconds passed first."""
        if self._pid != os.getpid():
            return True  # nothing submitted in this process
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            queue: _queue_module.SimpleQueue[_Message | _Flush | object] = _queue_module.SimpleQueue()
            pacing = _Pacing()
            thread = threading.Thread(target=self._serve, args=(queue, pacing), name="durable-publisher", daemon=True)
            thread.start()
            self._queue, self._pacing, self._thread = queue, pacing, thread
            self._pid = os.getpid()  # last: a submit that sees it finds the new queue

    def _serve(self, queue: _queue_module.SimpleQueue[_Message | _Flush | object], pacing: _Pacing) -> None:
        while True:
            try:
                items = [queue.get(timeout=pacing.until_collect())]
            except _queue_module.Empty:
                items = []  # the replies to what callers wrote are due
            waited = bool(items) and isinstance(items[0], _Message) and pacing.wait()
            with contextlib.suppress(_queue_module.Empty):
                while len(items) < PUBLISH_BATCH:
                    items.append(queue.get_nowait())
            messages = [item for item in items if isinstance(item, _Message)]
            flush = any(isinstance(item, _Flush) for item in items)
            if any(item is _WRITTEN for item in items):
                pacing.replies_written()
            try:
                if flush or pacing.collect_due():
                    messages += _collect(pacing, everything=flush)
                for app, group in itertools.groupby(messages, key=lambda m: m.app):
                    _publish(app, list(group))
            except BaseException:  # the thread must live on: the sweeper covers what was lost
                logger.exception("The durable publisher failed; the sweeper sends the pending runs again.")
            if messages:
                pacing.sent(len(messages), waited)
            for item in items:
                if isinstance(item, _Flush):
                    item.done.set()

    def at_exit(self) -> None:
        """Wait (``exit_timeout`` at most) for the messages still queued, and say if some were left."""
        if self._pid == os.getpid() and not self.flush(self.exit_timeout):
            logger.warning(
                "Exiting with run messages not yet published after %ss; the sweeper sends those runs after REDISPATCH_AFTER.",
                self.exit_timeout,
            )


class _Pacing:
    """When the publisher's thread waits before a batch (see ``Publisher``): batches at least
    ``PUBLISH_BATCH_INTERVAL`` apart, except after ``IDLE_WAITS`` waits in a row that gathered
    no other message."""

    def __init__(self) -> None:
        self.last_batch = -math.inf  # the last batch, or the last message a caller wrote itself
        self.idle_waits = 0  # waits in a row that gathered no other message
        self.at_once = 0  # messages that go without waiting, after IDLE_WAITS such waits
        self.collect_at: float | None = None  # when the thread reads the replies to what callers wrote
        self.last_submitted = -math.inf  # a caller last submitted a message (written or queued)

    def wait(self) -> bool:
        """Before a batch that starts with a message: wait out the rest of the interval since
        the last batch, unless it is over or messages go at once; whether it waited."""
        remaining = self.last_batch + conf.publish_batch_interval() - time.monotonic()
        if remaining <= 0:
            self.idle_waits = self.at_once = 0  # after a quiet spell, a burst waits again
            return False
        if self.at_once:
            self.at_once -= 1
            return False
        time.sleep(remaining)
        return True

    def write_now(self) -> bool:
        """(A caller's thread, for each message.) Whether the caller may write this message itself:
        the process's last message came at least ``DIRECT_WRITES_APART`` before (or the interval,
        if shorter). Messages that come faster go to the thread, which batches them."""
        now = time.monotonic()
        gap, self.last_submitted = now - self.last_submitted, now
        # The interval (a settings lookup) matters only when it is the shorter of the two.
        return gap >= DIRECT_WRITES_APART or gap >= conf.publish_batch_interval()

    def wrote(self) -> None:
        """(A caller's thread.) A message went, written by its caller: as a batch of one, the
        next batch waits out the interval from it. (Callers and the thread may both set these
        times: they decide when a message waits, never whether it is sent.)"""
        self.last_batch = time.monotonic()

    def replies_written(self) -> None:
        """(The thread.) A caller woke it for the replies to what it wrote: they are read
        ``COLLECT_INTERVAL`` from now (with those of the messages written meanwhile), unless a
        reading is due sooner."""
        if self.collect_at is None:
            self.collect_at = time.monotonic() + COLLECT_INTERVAL

    def until_collect(self) -> float | None:
        """(The thread.) How long it may wait for its queue before the replies are due (None: none is)."""
        return None if self.collect_at is None else max(0.0, self.collect_at - time.monotonic())

    def collect_due(self) -> bool:
        return self.collect_at is not None and self.collect_at <= time.monotonic()

    def collected(self, more: bool) -> None:
        """(The thread.) The replies that came are read; with ``more`` still to come, the next reading
        is ``COLLECT_INTERVAL`` from now (no caller wakes the thread for those)."""
        self.collect_at = time.monotonic() + COLLECT_INTERVAL if more else None

    def sent(self, messages: int, waited: bool) -> None:
        """After a batch of ``messages`` (one or more), published after ``wait`` said ``waited``."""
        self.last_batch = time.monotonic()
        if waited:
            # IDLE_WAITS waits in a row that gathered nothing: likely a chain (each message
            # starts the run that sends the next), which waiting only slows down.
            self.idle_waits = self.idle_waits + 1 if messages == 1 else 0
            if self.idle_waits >= IDLE_WAITS:
                self.idle_waits, self.at_once = 0, AT_ONCE_AFTER_IDLE_WAITS


#: This process's publisher (``durable.tasks.publisher.flush(timeout)`` waits for it).
publisher = Publisher()
atexit.register(publisher.at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=publisher._after_fork)
    os.register_at_fork(after_in_child=lambda: _forget_sessions())


@worker_process_shutdown.connect
def _flush_on_worker_process_exit(**kwargs: Any) -> None:
    """A prefork worker process leaves with ``os._exit`` (no atexit): publish what it queued."""
    publisher.at_exit()


class _Unreachable(Exception):
    """The broker did not answer the connection attempts of ``SEND_RETRY_POLICY``."""


def _publish(app: Celery, messages: list[_Message]) -> None:
    """Publish ``messages`` (one app's); log what could not be published (the sweeper sends it).

    A broker that does not answer gets the connection attempts of ``SEND_RETRY_POLICY``
    (one quick retry); a batch that fails once connected is published once more (a
    pooled connection gone stale reconnects; a message published twice is harmless,
    the claim is a compare-and-set)."""
    for attempt in range(2):
        try:
            if app_conf(app).sent_event:
                _publish_each(app, messages)
            else:
                _publish_batch(app, messages)
            return
        except _Unreachable as unreachable:
            error: BaseException = unreachable.__cause__ or unreachable
        except Exception as exc:
            error = exc
            if attempt == 0:
                continue
        break
    shown = ", ".join(m.run_id for m in messages[:50]) + (f" and {len(messages) - 50} more" if len(messages) > 50 else "")
    logger.error(
        "Could not send runs %s to the broker (%s: %s). The runs are saved as pending; "
        "the sweeper sends them again after REDISPATCH_AFTER (%ss).",
        shown,
        type(error).__name__,
        error,
        settings.REDISPATCH_AFTER,
        exc_info=wants_traceback(error, app),
    )


def _publish_each(app: Celery, messages: list[_Message]) -> None:
    """Celery's own ``apply_async``, message by message (it sends the task-sent events)."""
    task: Any = app.tasks[EXECUTE_TASK]
    for m in messages:
        send = functools.partial(
            task.apply_async,
            args=(m.run_id,),
            task_id=m.task_id,
            serializer="json",
            retry_policy=SEND_RETRY_POLICY,
            root_id=m.root_id,
            parent_id=m.parent_id,
            **queue_options(m.queue or ""),
        )
        if m.context is not None:
            m.context.run(send)
        else:
            send()


class _Defaults(NamedTuple):
    delivery_mode: Any
    routing_key: str | None
    compression: str | None
    retry_policy: dict[str, Any]


class _AppConf(NamedTuple):
    """What the start path reads from a Celery app's configuration, read once (a lookup in
    Celery's configuration costs tens of microseconds: it goes through Django's settings)."""

    eager: bool
    sent_event: bool
    task: Any
    #: The task's execution options (what ``apply_async`` starts from).
    options: dict[str, Any]
    #: The template message (``app.amqp.create_task_message``): headers, properties, embed.
    headers: dict[str, Any]
    properties: dict[str, Any]
    embed: Any
    defaults: _Defaults
    read_at: float
    #: By queue asked for (None: the default), where Celery's router sends a run's message,
    #: when the app has no ``task_routes`` (``_routed``): the route then depends on nothing else.
    routes: dict[str | None, tuple[Any, ...]]


#: Seconds an ``_AppConf`` is used before it is read again (and at once after Django's
#: ``setting_changed``, which ``override_settings`` sends).
CONF_TTL = 1.0
_app_confs: dict[Celery, _AppConf] = {}


def app_conf(app: Celery) -> _AppConf:
    known = _app_confs.get(app)
    if known is not None and time.monotonic() - known.read_at < CONF_TTL:
        return known
    conf = app.conf
    task: Any = app.tasks[EXECUTE_TASK]
    options = dict(task._get_exec_options(), serializer="json")
    headers, properties, body, _ = app.amqp.create_task_message(
        "",
        EXECUTE_TASK,
        ("",),
        {},
        time_limit=options.pop("time_limit", None),
        soft_time_limit=options.pop("soft_time_limit", None),
        ignore_result=task.ignore_result,
        # The app's, not the thread's (thread_oid): the same whichever thread reads this again, so a
        # re-read from another thread changes nothing and keeps the templates (results are ignored).
        reply_to=app.oid,
    )
    defaults = _Defaults(
        delivery_mode=conf.task_default_delivery_mode,
        routing_key=conf.task_default_routing_key,
        compression=conf.task_compression,
        retry_policy=dict(conf.task_publish_retry_policy or {}, **SEND_RETRY_POLICY),
    )
    known = _AppConf(
        eager=bool(conf.task_always_eager),
        sent_event=bool(conf.task_send_sent_event),
        task=task,
        options=options,
        headers=headers,
        properties=properties,
        embed=body[2],
        defaults=defaults,
        read_at=time.monotonic(),
        routes={},
    )
    _app_confs[app] = known
    return known


# django.dispatch.receiver, not ``@setting_changed.connect``: Django's ``connect`` returns None,
# so the function it connected (weakly) was collected at once and never called.
@receiver(setting_changed)
def _forget_app_confs(**kwargs: Any) -> None:
    _app_confs.clear()


class _Session:
    """What the publisher thread keeps from one batch to the next for an app: a producer of
    the app's pool, its connection checked, kombu's publish batch left open (one Redis client
    and pipeline), and the queues declared on its channel. Setting these up costs about
    0.6 ms, most of what a batch of one message costs; a session is set up again after any
    error (``close``) and when the app's producer pool is replaced."""

    def __init__(self, app: Celery) -> None:
        self.app, self.pool = app, app.producer_pool
        producer: Any = self.pool.acquire(block=True)
        self.producer = producer
        try:
            self.producer.connection.ensure_connection(**SEND_RETRY_POLICY)
        except Exception as exc:
            self.producer.release()
            raise _Unreachable() from exc
        self.batch: Any = self.producer.batch() if hasattr(self.producer, "batch") else None
        if self.batch is not None:
            self.batch.__enter__()
        self.declared: set[int] = set()
        #: By destination: the template of its messages (``_Template``), or None once given up.
        self.templates: dict[tuple[Any, ...], _Template | None] = {}
        self.tries: dict[tuple[Any, ...], int] = {}
        self.source: tuple[Any, ...] = ()
        #: The connection callers write templated messages on (``durable.tasks.direct``), once
        #: a template is verified; another is opened ``WRITER_AGAIN_AFTER`` seconds after one failed.
        self.writer: DirectWriter | None = None
        self.writer_at = 0.0  # monotonic time before which no writer is opened
        self.writer_failures = 0  # connection attempts in a row that failed (each waits twice as long)
        self.prefix = ""  # kombu's global_keyprefix, which the writer adds to a template's key

    def made_from(self, *source: Any) -> None:
        """Forget the templates when what Celery's part of a message is made from changed
        (``app_conf``, read again: the app's configuration, the thread asking first)."""
        if source != self.source:
            self.templates.clear()
            self.tries.clear()
            self.source = source

    def serves(self, app: Celery) -> bool:
        return app is self.app and app.producer_pool is self.pool

    def write(self, m: _Message, wake: Callable[[], None]) -> bool:
        """(A caller's thread.) Render ``m`` from its destination's verified template and write it
        on the session's direct connection (``DirectWriter.write``); False when it is not written
        that way (no writer, no template, or Celery's part of the message changed since the
        thread last looked): the thread publishes it."""
        writer, app = self.writer, m.app
        if writer is None or not DIRECT_WRITES or not self.serves(app):
            return False
        conf = app_conf(app)
        if conf.sent_event or conf.defaults.compression or (conf.headers, conf.properties, conf.embed) != self.source:
            return False
        routed = _routed(app, conf, m)
        template = self.template(routed.destination())
        if template is None:
            return False
        payload = template.render(m, routed.argsrepr, str(uuid.uuid4()))
        return writer.write(self.prefix + template.key, payload, m, wake)

    def open_writer(self) -> None:
        """(The publisher's thread, after a batch.) Open the direct connection once a template is
        verified, unless one is open or failed less than ``WRITER_AGAIN_AFTER`` seconds ago."""
        if self.writer is not None or not DIRECT_WRITES or time.monotonic() < self.writer_at:
            return
        if not any(template is not None and template.verified for template in self.templates.values()):
            return
        channel = self.producer.channel
        self.prefix = str(getattr(channel, "global_keyprefix", "") or "")
        try:
            self.writer = DirectWriter.open(channel)
        except Exception as exc:  # tried again later, each failure in a row doubling the wait (at most 64x)
            logger.debug("durable: no direct connection to the broker (%s: %s)", type(exc).__name__, exc)
            self.writer_failures += 1
            self.writer_at = time.monotonic() + WRITER_AGAIN_AFTER * 2 ** min(self.writer_failures, 6)
            return
        self.writer_failures = 0
        if self.writer is None:
            self.writer_at = math.inf  # not for this broker or process: never tried again in this session

    def collect(self, everything: bool) -> tuple[list[_Message], bool]:
        """(The publisher's thread.) ``DirectWriter.collect`` of the session's writer; a writer it
        gave up is forgotten (another opens ``WRITER_AGAIN_AFTER`` seconds later)."""
        writer = self.writer
        if writer is None:
            return [], False
        again, more = writer.collect(everything)
        if writer.broken:
            self.writer, self.writer_at = None, time.monotonic() + WRITER_AGAIN_AFTER
        return again, more

    def pipeline(self) -> Any:
        """The Redis pipeline of kombu's open publish batch (kombu 5.7's Redis transport), or
        None: no batch, another transport, or nothing published through the batch yet."""
        pipeline = getattr(getattr(getattr(self.batch, "state", None), "session", None), "pipeline", None)
        return pipeline if isinstance(getattr(pipeline, "command_stack", None), list) else None

    def template(self, destination: tuple[Any, ...]) -> _Template | None:
        """The verified template of ``destination``'s messages, if there is one."""
        template = self.templates.get(destination)
        return template if TEMPLATES and template is not None and template.verified else None

    def learning(self, destination: tuple[Any, ...]) -> bool:
        """Whether ``destination``'s template is still to be learned or checked: not known, not
        given up, and the session keeps fewer than ``TEMPLATE_DESTINATIONS`` (a router routing
        each run to a queue of its own would make one a run)."""
        if destination not in self.templates:
            return len(self.templates) < TEMPLATE_DESTINATIONS
        candidate = self.templates[destination]
        return candidate is not None and not candidate.verified

    def stacked(self) -> int:
        """How many commands kombu's pipeline holds (before a message ``learn`` reads)."""
        pipeline = self.pipeline()
        return len(pipeline.command_stack) if pipeline is not None else 0

    def learn(self, destination: tuple[Any, ...], m: _Message, argsrepr: str, stacked: int) -> None:
        """Learn ``destination``'s template from the message kombu just buffered for ``m``
        (the commands of its pipeline past ``stacked``): a first message gives a candidate,
        the next one checks it (rendered for that message, it must be the text kombu wrote).
        A destination whose messages are not one ``LPUSH`` (a queue with an expiry), or whose
        candidate failed the check, is never templated in this session; one whose message
        cannot be cut out (a run id found elsewhere in it) is tried again, a few times.
        Never raises: the message is kombu's, buffered already, whatever learning makes of it."""
        try:
            self._learn(destination, m, argsrepr, stacked)
        except Exception:
            logger.debug("durable: no template for the messages to %s", destination, exc_info=True)
            self.templates[destination] = None

    def _learn(self, destination: tuple[Any, ...], m: _Message, argsrepr: str, stacked: int) -> None:
        candidate = self.templates.get(destination)
        pipeline = self.pipeline()
        commands = pipeline.command_stack[stacked:] if pipeline is not None else []
        command: Any = commands[0][0] if len(commands) == 1 else ()
        if len(command) != 3 or command[0] != "LPUSH" or not isinstance(command[2], str):
            self.templates[destination] = None
            return
        prefix = getattr(pipeline, "global_keyprefix", "")  # kombu's global_keyprefix: the pipeline adds it
        key, payload = str(command[1]).removeprefix(prefix), command[2]
        if candidate is not None:  # this message checks the candidate
            tag = json.loads(payload)["properties"]["delivery_tag"]
            ok = candidate.key == key and candidate.render(m, argsrepr, tag) == payload
            self.templates[destination] = candidate._replace(verified=True) if ok else None
            return
        learned = _Template.learn(key, payload, m, argsrepr)
        tries = self.tries[destination] = self.tries.get(destination, 0) + 1
        if learned is not None:
            self.templates[destination] = learned
        elif tries >= TEMPLATE_TRIES:
            self.templates[destination] = None

    def flush(self, written: dict[str, list[str]]) -> None:
        """Send what the open batch holds, with the messages ``written`` from templates (by
        ``LPUSH`` key): one pipeline. The batch stays open for the next."""
        pipeline = self.pipeline() if written else None
        if written and pipeline is None:  # cannot be: a template is verified through the pipeline
            raise RuntimeError("durable: messages rendered from templates, and no pipeline to send them")
        if pipeline is not None:
            for key, payloads in written.items():
                pipeline.lpush(key, *payloads)
        if self.batch is not None:
            self.batch.state.flush()
        if pipeline is not None and pipeline.command_stack:
            pipeline.execute()  # kombu buffered none of its own: it left the pipeline to us

    def close(self) -> list[_Message]:
        """Drop the batch (what it holds unsent is given up: the caller logs it) and hand the
        producer back to the pool with its connection closed (the next one connects anew).
        Returns the messages written directly whose replies were not read (to publish again)."""
        left = self.writer.close() if self.writer is not None else []
        self.writer = None
        if self.batch is not None:
            with contextlib.suppress(Exception):
                self.batch.__exit__(RuntimeError, RuntimeError("publish failed"), None)  # discards, never flushes
        with contextlib.suppress(Exception):
            self.producer.connection.close()
        with contextlib.suppress(Exception):
            self.producer.release()
        return left


#: The publisher thread's sessions, by app (only that thread uses them; a forked child starts without).
_sessions: dict[Celery, _Session] = {}


def _session(app: Celery) -> _Session:
    session = _sessions.get(app)
    if session is not None and not session.serves(app):
        del _sessions[app]  # first: if setting up the next one fails, this one is never used again
        publisher.again(session.close())
        session = None
    if session is None:
        session = _sessions[app] = _Session(app)
    return session


def _collect(pacing: _Pacing, everything: bool) -> list[_Message]:
    """(The thread.) Read the replies to the messages callers wrote directly, for every session
    (all of them when ``everything``: a flush waits): the messages to publish through kombu
    (refused, or not confirmed by a connection that failed). Reads again later
    (``_Pacing.collected``) when replies are still to come, or if reading failed."""
    again: list[_Message] = []
    pacing.collected(more=True)
    more = False
    for session in list(_sessions.values()):
        refused, left = session.collect(everything)
        again += refused
        more = more or left
    pacing.collected(more)
    return again


def _forget_sessions() -> None:
    """In a forked child: the parent's connections are not this process's to use or close."""
    _sessions.clear()


def _publish_batch(app: Celery, messages: list[_Message]) -> None:
    """Through the thread's session for ``app`` (one Redis pipeline per batch with kombu 5.7+),
    from one template message; a failure closes the session and is raised to ``_publish``."""
    conf = app_conf(app)
    headers, properties, embed, defaults = conf.headers, conf.properties, conf.embed, conf.defaults
    published: list[tuple[_Message, dict[str, Any], Any, str]] = []
    written: dict[str, list[str]] = {}  # by LPUSH key, the messages rendered from templates
    session = _session(app)
    session.made_from(headers, properties, embed)
    producer = session.producer
    try:
        with producer.connection._reraise_as_library_errors():
            for m in messages:
                args = (m.run_id,)
                exchange, routing_key, delivery_mode, queue, priority, argsrepr = routed = _routed(app, conf, m)
                destination = routed.destination()
                templated = m.context is None and not defaults.compression  # else kombu builds it, always
                template = session.template(destination) if templated else None
                if template is not None:
                    written.setdefault(template.key, []).append(template.render(m, argsrepr, str(uuid.uuid4())))
                    continue
                if queue is not None and id(queue) not in session.declared:
                    session.declared.add(id(queue))
                    maybe_declare(queue.bind(producer.channel), producer.channel)  # once per session, as Celery's
                h = dict(headers)
                h["id"], h["root_id"], h["parent_id"] = m.task_id, m.root_id or m.task_id, m.parent_id
                h["argsrepr"] = argsrepr
                props = dict(properties, correlation_id=m.task_id)
                if priority is not None:
                    props["priority"] = priority
                message_body: tuple[Any, ...] = (args, {}, embed)
                if m.context is not None and signals.before_task_publish.receivers:
                    m.context.run(
                        signals.before_task_publish.send,
                        sender=EXECUTE_TASK,
                        body=message_body,
                        exchange=exchange,
                        routing_key=routing_key,
                        declare=[queue] if queue is not None else [],
                        headers=h,
                        properties=props,
                        retry_policy=defaults.retry_policy,
                    )
                learning = templated and session.learning(destination)
                stacked = session.stacked() if learning else 0
                producer.publish(
                    message_body,
                    exchange=exchange,
                    routing_key=routing_key,
                    serializer="json",
                    compression=defaults.compression,
                    delivery_mode=delivery_mode,
                    headers=h,
                    **props,
                )
                if m.context is not None:
                    published.append((m, h, exchange, routing_key))
                if learning:
                    session.learn(destination, m, argsrepr, stacked)
            session.flush(written)
            session.open_writer()
    except BaseException:
        _sessions.pop(app, None)
        publisher.again(session.close())
        raise
    for m, h, exchange, routing_key in published:  # the batch reached the broker
        if m.context is not None and signals.after_task_publish.receivers:
            m.context.run(
                signals.after_task_publish.send,
                sender=EXECUTE_TASK,
                body=((m.run_id,), {}, embed),
                headers=h,
                exchange=exchange,
                routing_key=routing_key,
            )


#: Messages of a destination that fail to give a template before it is given up (a session's).
TEMPLATE_TRIES = 3
#: Destinations a session keeps templates for; the messages of others are built by kombu.
TEMPLATE_DESTINATIONS = 64
#: False: every message is built by Celery and kombu (bench section (a) compares).
TEMPLATES = True
#: False: the caller never writes a message itself; every one goes through the publisher's
#: thread (bench sections (a) and (f) compare).
DIRECT_WRITES = True
#: Seconds after a direct connection failed before the session opens another.
WRITER_AGAIN_AFTER = 1.0
#: Seconds the replies to the messages callers wrote gather before the publisher's thread reads
#: them (a flush reads them at once): each reading costs the thread a wake-up, and a reply only
#: confirms a message (one Redis refused, or a connection lost, is published again through
#: kombu after at most this long). With one reading every 5 ms, the thread cost 60-100 us of
#: CPU a message in bench section (a) (four processes); with 50 ms, about 10.
COLLECT_INTERVAL = 0.05
#: Shortest time in seconds between two messages of a process for the second to be written by
#: its caller (``PUBLISH_BATCH_INTERVAL`` if shorter): a process starting more runs than about a
#: thousand a second hands them to the thread, whose pipeline a batch costs less CPU than a
#: write a message (bench section (a), one process: about 10% more starts a second).
DIRECT_WRITES_APART = 0.001

#: Where a template takes a message's own values: a JSON text never holds a NUL character.
_BODY, _TAG, _LINEAGE, _TASK_ID, _ARGSREPR, _RUN_ID = (f"\x00{mark}\x00" for mark in "BTLIAR")


class _Template(NamedTuple):
    """The message of a destination as kombu's Redis transport writes it (the text of its
    ``LPUSH``), learned from a real message with the values that differ from run to run
    cut out: the task id (``id`` and ``correlation_id``), the root and parent ids, the
    ``argsrepr``, the body (base64 of the JSON arguments) and the delivery tag.

    Rendering one costs a few string replacements, where kombu and Celery build the message
    anew (serializing it twice): less than half the CPU. The text stays kombu's own, whatever
    its version writes: a template is used only once it rendered the next real message
    exactly as kombu wrote it (``_Session.learn``)."""

    key: str
    text: str
    body: str
    verified: bool = False

    @classmethod
    def learn(cls, key: str, payload: str, m: _Message, argsrepr: str) -> _Template | None:
        """The candidate template cut out of ``payload``, kombu's text for ``m``; None when
        a value to cut out is not found exactly once (or the run id is found elsewhere)."""
        try:
            envelope = json.loads(payload)
            body, tag = envelope["body"], envelope["properties"]["delivery_tag"]
            decoded = base64.b64decode(body, validate=True).decode()
        except Exception:
            return None
        text, run_id, task_id = payload, _json(m.run_id), _json(m.task_id)
        for value, mark in ((_json(body), _BODY), (_json(tag), _TAG), (_lineage(m), _LINEAGE), (_json(argsrepr), _ARGSREPR)):
            if text.count(value) != 1:
                return None
            text = text.replace(value, mark)
        if task_id not in text or decoded.count(run_id) != 1:
            return None
        text, decoded = text.replace(task_id, _TASK_ID), decoded.replace(run_id, _RUN_ID)
        if m.run_id in text or m.run_id in decoded:
            return None
        return cls(key, text, decoded)

    def render(self, m: _Message, argsrepr: str, tag: str) -> str:
        """The text kombu would write for ``m`` (with delivery tag ``tag``)."""
        body = base64.b64encode(self.body.replace(_RUN_ID, _json(m.run_id)).encode()).decode()
        return (
            self.text.replace(_BODY, _json(body))
            .replace(_TAG, _json(tag))
            .replace(_LINEAGE, _lineage(m))
            .replace(_TASK_ID, _json(m.task_id))
            .replace(_ARGSREPR, _json(argsrepr))
        )


def _json(value: str | None) -> str:
    """``value`` as kombu's JSON writes it (a string's escapes as ``json.dumps``), without the
    encoder ``json.dumps`` makes at each call: most of what rendering a message would cost."""
    return "null" if value is None else json.encoder.encode_basestring_ascii(value)


def _lineage(m: _Message) -> str:
    """The root and parent ids in a message's headers, as Celery orders them and kombu writes them."""
    return f'"root_id": {_json(m.root_id or m.task_id)}, "parent_id": {_json(m.parent_id)}'


class _Routed(NamedTuple):
    """Where Celery's router sends a run's message, and its ``argsrepr``."""

    exchange: Any
    routing_key: Any
    delivery_mode: Any
    queue: Any  # to declare, or None
    priority: Any
    argsrepr: str

    def destination(self) -> tuple[Any, ...]:
        """What the message's text depends on, besides the run: its route (a template's key)."""
        return (getattr(self.exchange, "name", self.exchange), self.routing_key, self.delivery_mode, self.priority)


def _routed(app: Celery, conf: _AppConf, m: _Message) -> _Routed:
    """Route ``m`` as ``apply_async`` would (the app's routers, its queues). Without
    ``task_routes`` the route depends only on the queue asked for and the configuration
    (``conf``, read again every ``CONF_TTL``): it is kept in ``conf.routes``, which spares
    each message Celery's router (about 15 us; 50 us after a quiet spell)."""
    amqp, args = app.amqp, (m.run_id,)
    where = conf.routes.get(m.queue)
    if where is None:
        wanted = dict(conf.options, queue=m.queue) if m.queue else dict(conf.options)
        router = amqp.router
        route = router.route(wanted, EXECUTE_TASK, args, {}, conf.task)
        where = (*_destination(amqp, route, conf.defaults), route.get("priority"))
        if not getattr(router, "routes", True):
            conf.routes[m.queue] = where
    argsrepr = repr(args)
    if len(argsrepr) > amqp.argsrepr_maxsize:
        argsrepr = saferepr(args, amqp.argsrepr_maxsize)
    exchange, routing_key, delivery_mode, queue, priority = where
    return _Routed(exchange, routing_key, delivery_mode, queue, priority, argsrepr)


def _destination(amqp: Any, route: dict[str, Any], defaults: _Defaults) -> tuple[Any, Any, Any, Any]:
    """(exchange, routing key, delivery mode, queue to declare) of a routed message, by Celery's
    rules: a direct exchange without an explicit exchange and routing key is published through
    the default exchange with the queue's name as routing key."""
    queue, exchange, routing_key = route.get("queue"), route.get("exchange"), route.get("routing_key")
    if queue is None and exchange is None:
        queue = amqp.default_queue
    name = queue
    if isinstance(queue, str):
        queue = amqp.queues[queue]
    elif queue is not None:
        name = queue.name
    queue_exchange = getattr(queue, "exchange", None)
    delivery_mode = route.get("delivery_mode") or getattr(queue_exchange, "delivery_mode", None) or defaults.delivery_mode
    exchange_type = route.get("exchange_type") or getattr(queue_exchange, "type", None) or "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", name
    elif exchange is None:
        exchange = queue_exchange.name if queue_exchange is not None and queue_exchange.name else amqp.default_exchange
        routing_key = routing_key or getattr(queue, "routing_key", None) or defaults.routing_key
    declare = queue if queue is not None and not isinstance(queue, Broadcast) else None
    return exchange, routing_key, delivery_mode, declare
