"""The background publisher of run messages (``durable.tasks.publisher``), on
PostgreSQL and a real Redis broker.

A start hands its Celery message to the publisher on commit and returns; the
publisher's thread publishes it (in batches) to the broker. The run row is the
outbox: what the publisher cannot publish is logged, and the sweeper sends it
(see test_broker_down.py for the broker being down).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kombu.messaging
import pytest
import redis
from celery import Celery, signals
from kombu import Queue as KombuQueue

from durable import DjangoStore, Engine, conf, engine, models, tasks
from durable.tasks import CeleryDispatcher, publishing
from testproject.celery import app as celery_app
from tests.api.helpers import add_input
from tests.processes import ROOT
from tests.threads import started

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

#: Set by a test before it starts a run: the publish signals must see the caller's value.
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("CALLER", default="not the caller's context")


@pytest.fixture
def queue(settings: Any) -> Iterator[str]:
    """A queue of this test's own on the real Redis broker (no worker consumes it)."""
    if not str(celery_app.conf.broker_url).startswith("redis://"):
        pytest.skip("needs a Redis broker: set CELERY_BROKER_URL")
    name = f"publisher-{uuid.uuid4().hex[:8]}"
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": name}
    yield name
    _drain(name)


def _drain(queue: str, wait: float = 0.2) -> list[dict[str, Any]]:
    """Take every message out of ``queue``: their headers."""
    headers: list[dict[str, Any]] = []
    with celery_app.connection_for_write() as conn, conn.SimpleQueue(queue) as q:
        while True:
            try:
                message = q.get(timeout=wait)
            except q.Empty:
                return headers
            headers.append(dict(message.headers))
            message.ack()


def _ids(headers: list[dict[str, Any]]) -> list[str]:
    return sorted(h["id"] for h in headers)


def _engine() -> Engine:
    return Engine(DjangoStore(), dispatch=CeleryDispatcher())


@pytest.fixture
def through_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message goes through the publisher's thread: no caller writes one itself
    (``publishing.DIRECT_WRITES``), for the tests of the thread's batches."""
    monkeypatch.setattr(publishing, "DIRECT_WRITES", False)


def test_a_start_returns_before_its_message_is_published_then_the_message_is_published(queue: str) -> None:
    release, entered = threading.Event(), threading.Event()
    seen: list[str] = []

    def block(sender: str, headers: dict[str, Any], **kwargs: Any) -> None:
        seen.append(CALLER.get())
        entered.set()
        assert release.wait(60)

    signals.before_task_publish.connect(block, weak=False)
    try:
        token = CALLER.set("the caller")
        try:
            handle = _engine().start("test.add", add_input("k"))  # returns while the publisher is held
        finally:
            CALLER.reset(token)
        assert entered.wait(30)
        assert _drain(queue) == []  # not published yet
        assert models.WorkflowRun.objects.get(run_id=handle.run_id).status == "pending"
        release.set()
        assert tasks.publisher.flush(timeout=30)
    finally:
        release.set()
        signals.before_task_publish.disconnect(block)
    [message] = _drain(queue)
    assert message["id"] == tasks.task_id(handle.run_id, 0)
    assert message["task"] == tasks.EXECUTE_TASK
    assert message["argsrepr"] == repr((handle.run_id,))
    assert seen == ["the caller"]  # the signal ran in a copy of the caller's context


def test_the_message_is_the_one_apply_async_sends(queue: str, settings: Any) -> None:
    """Same task, id, arguments, routing, serializer and options as ``PUBLISH_IN_BACKGROUND`` off."""
    background = _engine().start("test.add", add_input("k"))
    assert tasks.publisher.flush(timeout=30)
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_IN_BACKGROUND": False}
    synchronous = _engine().start("test.add", add_input("k"))
    # Off, the caller's thread sent it before start() returned: no flush needed.
    got = {h["id"]: h for h in _drain(queue)}
    assert set(got) == {tasks.task_id(background.run_id, 0), tasks.task_id(synchronous.run_id, 0)}
    ours, celerys = got[tasks.task_id(background.run_id, 0)], got[tasks.task_id(synchronous.run_id, 0)]
    differ = {"id", "root_id", "argsrepr", "origin"}
    assert {k: v for k, v in ours.items() if k not in differ} == {k: v for k, v in celerys.items() if k not in differ}
    assert ours["root_id"] == ours["id"] and ours["parent_id"] is None
    assert ours["ignore_result"] is True


def test_a_message_that_cannot_be_published_is_logged_and_the_run_stays_pending(
    queue: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after connecting (here: every publish raises) is retried once, then logged; never raised."""
    calls: list[str] = []

    def refuse(self: Any, body: Any, **kwargs: Any) -> None:
        calls.append(kwargs["headers"]["id"])
        raise ConnectionResetError("the broker went away")

    monkeypatch.setattr("kombu.messaging.Producer.publish", refuse)
    handle = _engine().start("test.add", add_input("k"))
    assert tasks.publisher.flush(timeout=30)
    monkeypatch.undo()
    message_id = tasks.task_id(handle.run_id, 0)
    assert calls == [message_id, message_id]  # one retry
    assert models.WorkflowRun.objects.get(run_id=handle.run_id).status == "pending"
    assert any(r.levelname == "ERROR" and handle.run_id in r.getMessage() and "sweeper" in r.getMessage() for r in caplog.records)
    assert _drain(queue) == []


def _texts(keys: list[str]) -> dict[str, list[str]]:
    """The text of every message waiting in each Redis list of ``keys`` (as a worker would
    take them: oldest first), and the lists emptied."""
    client = redis.Redis.from_url(str(celery_app.conf.broker_url))
    try:
        texts = {key: [raw.decode() for raw in reversed(client.lrange(key, 0, -1))] for key in keys}
        client.delete(*keys)
    finally:
        client.close()
    return texts


def _templates(session: Any, key: str) -> list[Any]:
    """The templates of ``session`` that write to the Redis list ``key`` (learned or checked)."""
    return [t for t in session.templates.values() if t is not None and t.key == key]


def _untagged(text: str) -> str:
    """A message's text with its delivery tag (a fresh uuid for each message) blanked."""
    return text.replace(json.loads(text)["properties"]["delivery_tag"], "<tag>")


def _messages(app: Any, count: int, queue: str | None = None, parent: str | None = None) -> list[Any]:
    run_ids = [uuid.uuid4().hex for _ in range(count)]
    root = "root-task" if parent else None
    return [publishing._Message(app, r, f"{r}:2", queue, root, parent, None) for r in run_ids]


def _templated_and_kombus(
    app: Any, messages: list[Any], keys: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``messages`` published from templates, then the same ones built by kombu and Celery
    (the templates put aside): the texts each wrote in ``keys``."""
    publishing._publish(app, messages)
    templated = _texts(keys)
    with monkeypatch.context() as patched:
        patched.setattr(publishing._Session, "template", lambda self, destination: None)
        publishing._publish(app, messages)
    return templated, _texts(keys)


@contextlib.contextmanager
def _app(name: str, **conf: Any) -> Iterator[Celery]:
    """A Celery app of the test's own (durable's tasks registered), configured with ``conf``;
    the publisher session the test's calls made for it closed after."""
    app = Celery(name, set_as_current=False)
    for setting, value in conf.items():
        setattr(app.conf, setting, value)
    app.finalize()
    try:
        yield app
    finally:
        session = publishing._sessions.pop(app, None)
        if session is not None:
            session.close()


def test_messages_written_from_a_template_are_the_text_kombu_writes(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first message of a destination goes through kombu and gives the template, the
    second (through kombu too) checks it, the next ones are rendered: byte for byte what
    kombu and Celery write for them, delivery tag aside (a fresh one each)."""
    e = _engine()
    learners = [e.start("test.add", add_input(f"l{n}")).run_id for n in range(2)]
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    assert [t.verified for t in _templates(session, queue)] == [True]
    assert [json.loads(t)["headers"]["id"] for t in _texts([queue])[queue]] == [tasks.task_id(r, 0) for r in learners]

    # Three starts, and a run started from inside a worker's task (its root and parent ids).
    messages = _messages(celery_app, 3, queue) + _messages(celery_app, 1, queue, parent="parent-task")
    templated, kombus = _templated_and_kombus(celery_app, messages, [queue], monkeypatch)
    assert [json.loads(t)["headers"]["id"] for t in templated[queue]] == [m.task_id for m in messages]
    assert [_untagged(t) for t in templated[queue]] == [_untagged(t) for t in kombus[queue]]
    tags = {json.loads(t)["properties"]["delivery_tag"] for t in templated[queue]}
    assert len(tags) == len(messages)  # each its own delivery tag (kombu's Redis QoS acks by it)
    last = json.loads(templated[queue][-1])["headers"]
    assert (last["root_id"], last["parent_id"]) == ("root-task", "parent-task")


def test_templates_follow_the_route_of_each_message(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that routes by the run id (to one queue or another, with a priority or not)
    and a global key prefix: each message goes where kombu would have put it, as its text."""
    names = {"low": f"{queue}-low", "high": f"{queue}-high"}

    def route(name: str, args: tuple[Any, ...], kwargs: Any, options: Any, task: Any = None, **kw: Any) -> dict[str, Any]:
        if name != tasks.EXECUTE_TASK:
            return {}
        high = int(args[0][-1], 16) % 2 == 1
        return {"queue": names["high"], "priority": 6} if high else {"queue": names["low"]}

    prefixed = {"global_keyprefix": "durable-test:"}
    with _app("durable-templates", task_routes=(route,), broker_transport_options=prefixed) as app:
        high = "\x06\x16" + "6"  # kombu's Redis key of a priority-6 message: the queue, a separator, the step
        keys = [f"durable-test:{names['low']}", f"durable-test:{names['high']}{high}"]
        learners = _messages(app, 24)
        publishing._publish(app, learners[:12])
        publishing._publish(app, learners[12:])  # each destination learned and checked its template
        _texts(keys)
        session = publishing._sessions[app]
        assert sorted(t.key for t in session.templates.values() if t is not None and t.verified) == sorted(
            [names["low"], names["high"] + high]
        )
        messages = _messages(app, 20)
        templated, kombus = _templated_and_kombus(app, messages, keys, monkeypatch)
        for key in keys:
            assert templated[key] and [_untagged(t) for t in templated[key]] == [_untagged(t) for t in kombus[key]]
        routed = {json.loads(t)["headers"]["argsrepr"]: key for key in keys for t in templated[key]}
        for m in messages:
            assert routed[repr((m.run_id,))] == keys[int(m.run_id[-1], 16) % 2]


def test_without_task_routes_each_queue_is_routed_by_celery_once_per_reading_of_the_configuration(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No router can route by the run: the route of a queue (or of the default one) is kept
    with the configuration read, until it is read again; each message still goes where
    ``apply_async`` puts it."""
    other = f"{queue}-other"
    with _app("durable-routes", task_default_queue=queue) as app:
        router, asked = app.amqp.router, []
        route = router.route
        monkeypatch.setattr(router, "route", lambda options, *args: asked.append(options.get("queue")) or route(options, *args))
        messages = _messages(app, 3) + _messages(app, 3, other)
        publishing._publish(app, messages)
        assert asked == [None, other]
        publishing._forget_app_confs()  # the configuration read again (setting_changed): its routes too
        again = _messages(app, 2)
        publishing._publish(app, again)
        assert asked == [None, other, None]
        texts = _texts([queue, other])
    assert [json.loads(t)["headers"]["id"] for t in texts[queue]] == [m.task_id for m in messages[:3] + again]
    assert [json.loads(t)["headers"]["id"] for t in texts[other]] == [m.task_id for m in messages[3:]]


def test_a_changed_setting_makes_the_publisher_read_the_configuration_again(settings: Any) -> None:
    """``override_settings`` (here pytest-django's ``settings``) sends ``setting_changed``: the
    configuration the publisher read (its route by queue too) is read again at the next message."""
    publishing.app_conf(celery_app)
    assert celery_app in publishing._app_confs
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": "elsewhere"}
    assert celery_app not in publishing._app_confs


def test_a_destination_whose_message_is_more_than_one_command_is_never_templated(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue with an expiry (kombu adds a PEXPIRE to each message's LPUSH) is published
    through kombu, message by message, as before."""
    built: list[str] = []
    publish = kombu.messaging.Producer.publish

    def counted(self: Any, body: Any, **kwargs: Any) -> Any:
        built.append(kwargs["headers"]["id"])
        return publish(self, body, **kwargs)

    monkeypatch.setattr(kombu.messaging.Producer, "publish", counted)
    with _app("durable-templates-expiry", task_queues=[KombuQueue(queue, expires=60)], task_default_queue=queue) as app:
        messages = _messages(app, 5)
        publishing._publish(app, messages[:2])
        publishing._publish(app, messages[2:])
        assert built == [m.task_id for m in messages]  # every one through kombu
        assert set(publishing._sessions[app].templates.values()) == {None}
        assert [json.loads(t)["headers"]["id"] for t in _texts([queue])[queue]] == [m.task_id for m in messages]


def test_a_template_that_does_not_render_the_next_message_as_kombu_wrote_it_is_given_up(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever kombu writes that a template would render otherwise (here: every rendering is
    made wrong), the destination's messages go on through kombu, all of them, as kombu writes them."""
    render = publishing._Template.render
    monkeypatch.setattr(publishing._Template, "render", lambda *args: render(*args).replace('"lang"', '"language"'))
    e = _engine()
    run_ids = [e.start("test.add", add_input(f"g{n}")).run_id for n in range(5)]
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    # Given up: the destination (its routing key is the queue's name) holds no template.
    assert [template for destination, template in session.templates.items() if queue in destination] == [None]
    texts = _texts([queue])[queue]
    assert [json.loads(t)["headers"]["id"] for t in texts] == [tasks.task_id(r, 0) for r in run_ids]
    assert all('"lang": "py"' in t for t in texts)


def test_a_template_that_cannot_be_learned_for_any_reason_never_fails_the_batch(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Learning reads kombu's text after kombu buffered the message: whatever goes wrong
    there gives the destination up, and the batch is published whole."""

    def breaks(*args: Any) -> None:
        raise KeyError("properties")

    monkeypatch.setattr(publishing._Template, "learn", breaks)
    e = _engine()
    run_ids = [e.start("test.add", add_input(f"b{n}")).run_id for n in range(3)]
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    assert [template for destination, template in session.templates.items() if queue in destination] == [None]
    assert _ids(_drain(queue)) == sorted(tasks.task_id(r, 0) for r in run_ids)


def test_compressed_messages_are_never_templated(queue: str) -> None:
    with _app("durable-templates-gzip", task_compression="gzip") as app:
        messages = _messages(app, 4, queue)
        publishing._publish(app, messages[:2])
        publishing._publish(app, messages[2:])
        assert publishing._sessions[app].templates == {}
        headers = [json.loads(t)["headers"] for t in _texts([queue])[queue]]
        assert [h["id"] for h in headers] == [m.task_id for m in messages]
        assert {h["compression"] for h in headers} == {"application/x-gzip"}


@pytest.fixture
def own_session() -> Iterator[None]:
    """The app's publisher session made by the test's thread (kombu's publish batch is the
    thread's that opened it: from another thread, kombu publishes at once, without the
    batch, and no template is learned), and dropped after the test."""

    def drop() -> None:
        session = publishing._sessions.pop(celery_app, None)
        if session is not None:
            session.close()

    assert tasks.publisher.flush(timeout=10)
    drop()
    yield
    drop()


def test_templates_are_learned_again_when_what_celery_makes_a_message_from_changed(
    queue: str, own_session: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's part of the message is read again from the app (``app_conf``, every second):
    when it differs, the templates made from the old one are dropped, so a message never
    carries what kombu would no longer write."""
    learners = _messages(celery_app, 3, queue)
    publishing._publish(celery_app, learners)
    session = publishing._sessions[celery_app]
    assert [t.verified for t in _templates(session, queue)] == [True]
    conf = publishing.app_conf(celery_app)
    moved = conf._replace(headers={**conf.headers, "origin": "elsewhere@durable"}, read_at=time.monotonic() + 60)
    monkeypatch.setitem(publishing._app_confs, celery_app, moved)
    messages = _messages(celery_app, 4, queue)
    publishing._publish(celery_app, messages)
    headers = [json.loads(t)["headers"] for t in _texts([queue])[queue]]
    assert [h["id"] for h in headers] == [m.task_id for m in learners + messages]
    assert [h["origin"] for h in headers[3:]] == ["elsewhere@durable"] * 4
    assert [t.verified for t in _templates(session, queue)] == [True]  # learned again from the new one


def test_a_session_keeps_templates_for_a_bounded_number_of_destinations(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that sends each run to a queue of its own would otherwise make a template a run."""
    monkeypatch.setattr(publishing, "TEMPLATE_DESTINATIONS", 1)
    queues = [f"{queue}-a", f"{queue}-b"]
    with _app("durable-templates-bounded") as app:
        messages = [m for name in queues for m in _messages(app, 4, name)]
        publishing._publish(app, messages)
        templates = publishing._sessions[app].templates
        assert [t.key for t in templates.values() if t is not None and t.verified] == [queues[0]]
        texts = _texts(queues)
        assert [json.loads(t)["headers"]["id"] for name in queues for t in texts[name]] == [m.task_id for m in messages]


#: The RabbitMQ that ``bin/services`` starts (guest/guest on localhost).
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def test_on_rabbitmq_every_message_is_built_by_kombu_and_published() -> None:
    """AMQP has no publish batch in kombu: no pipeline to learn a template from, so every
    message goes through kombu, one by one, as before the templates; none is lost."""
    name = f"publisher-amqp-{uuid.uuid4().hex[:8]}"
    # What publishes: broker_write_url (CELERY_BROKER_URL, which bin/test sets, wins over broker_url).
    with _app("durable-templates-amqp", broker_write_url=RABBITMQ) as app:
        messages = _messages(app, 5, name)
        publishing._publish(app, messages[:2])
        publishing._publish(app, messages[2:])
        assert set(publishing._sessions[app].templates.values()) == {None}  # given up: never rendered
        received = []
        with app.connection_for_write() as conn:
            assert conn.transport.driver_type == "amqp"
            with conn.SimpleQueue(name) as q:
                for _ in messages:
                    message = q.get(timeout=10)
                    received.append(message.headers["id"])
                    message.ack()
            conn.default_channel.queue_delete(name)
        assert received == [m.task_id for m in messages]


def test_a_run_id_found_elsewhere_in_its_message_gives_no_template(queue: str) -> None:
    """A run id that is also part of something else in its message (here "json", in the
    content type "application/json") cannot be cut out: the next message is tried instead."""
    e = _engine()
    odd = e.start("test.add", add_input("o"), run_id="json").run_id
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    assert _templates(session, queue) == []
    learners = [e.start("test.add", add_input(f"l{n}")).run_id for n in range(2)]
    assert tasks.publisher.flush(timeout=10)
    assert [t.verified for t in _templates(session, queue)] == [True]
    assert _ids(_drain(queue)) == sorted(tasks.task_id(r, 0) for r in [odd, *learners])


def test_the_session_is_kept_between_batches_and_set_up_again_after_a_failure(
    queue: str, through_the_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = _engine()
    first = e.start("test.add", add_input("s1")).run_id
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    second = e.start("test.add", add_input("s2")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert publishing._sessions[celery_app] is session  # no new producer, client or pipeline per batch

    failures: list[str] = []
    flush = publishing._Session.flush

    def fails_once(self: Any, written: dict[str, list[str]]) -> None:
        if not failures:
            failures.append("the connection broke")
            raise ConnectionError("the connection broke")
        flush(self, written)

    monkeypatch.setattr(publishing._Session, "flush", fails_once)
    third = e.start("test.add", add_input("s3")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert failures and publishing._sessions[celery_app] is not session
    # The failed batch was given up whole and published once more by a new session: once each.
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in (first, second, third))


def test_after_the_broker_was_unreachable_a_new_session_publishes(queue: str) -> None:
    # The app's pool is replaced while the broker is down (a session cannot be set up),
    # then put back: the session of before is closed and never used again.
    from tests.integration.test_broker_down import DeadBroker

    e = _engine()
    before = e.start("test.add", add_input("u1")).run_id
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    dead = DeadBroker()
    try:
        lost = e.start("test.add", add_input("u2")).run_id  # logged; the sweeper would send it
        assert tasks.publisher.flush(timeout=30)
    finally:
        dead.restore()
    assert publishing._sessions.get(celery_app) is not session  # closed when the pool was replaced: never again
    after = e.start("test.add", add_input("u3")).run_id
    assert tasks.publisher.flush(timeout=10)
    sent = _ids(_drain(queue))
    assert sent == sorted(tasks.task_id(run_id, 0) for run_id in (before, after))
    assert tasks.task_id(lost, 0) not in sent


def _started_from_many_threads(label: str, threads: int = 8, per_thread: int = 25) -> list[str]:
    """``threads`` threads, released at once, each starting ``per_thread`` runs with its own
    engine: the run ids, once the publisher has every message."""
    barrier = threading.Barrier(threads)

    def starts(i: int) -> list[str]:
        e = _engine()
        barrier.wait(timeout=30)
        return [e.start("test.add", add_input(f"{label}{i}-{j}")).run_id for j in range(per_thread)]

    workers = [started(lambda i=i: starts(i)) for i in range(threads)]
    run_ids = [run_id for w in workers for run_id in w.outcome()]
    assert tasks.publisher.flush(timeout=60)
    assert len(set(run_ids)) == threads * per_thread
    return run_ids


def test_many_threads_starting_at_once_each_get_exactly_one_message(queue: str) -> None:
    run_ids = _started_from_many_threads("t")
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in run_ids)


def _batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, list[str]]]:
    """Each batch the publisher publishes from now on: (time.monotonic() as it went out, its run ids)."""
    batches: list[tuple[float, list[str]]] = []
    publish_batch = publishing._publish_batch

    def recorded(app: Any, messages: list[Any]) -> None:
        batches.append((time.monotonic(), [m.run_id for m in messages]))
        publish_batch(app, messages)

    monkeypatch.setattr(publishing, "_publish_batch", recorded)
    return batches


def test_messages_soon_after_a_batch_wait_for_the_interval_and_go_out_together(
    queue: str, settings: Any, through_the_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 1.0  # the longest allowed: long beside the starts of the burst, even on a slow machine
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": interval}
    e = _engine()
    assert tasks.publisher.flush(timeout=10)
    time.sleep(interval)  # a quiet spell: the last batch of the publisher is older than the interval
    batches = _batches(monkeypatch)
    first = e.start("test.add", add_input("i0")).run_id
    assert tasks.publisher.flush(timeout=interval / 2)  # after a quiet spell: at once
    burst = [e.start("test.add", add_input(f"i{n}")).run_id for n in range(1, 6)]
    assert not tasks.publisher.flush(timeout=interval / 8)  # right after a batch: waiting out the interval
    assert tasks.publisher.flush(timeout=10)
    assert [ids for _, ids in batches] == [[first], burst]  # the five in one pipeline
    assert batches[1][0] - batches[0][0] >= interval * 0.99
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in [first, *burst])


def test_a_chain_of_messages_each_sent_after_the_last_was_published_waits_once_in_a_while(
    queue: str, settings: Any, through_the_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's chain of hand-offs: each message comes only once the one before was published
    (its run ran and ended), so a wait for the interval gathers nothing and only slows it down."""
    interval = 1.0
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": interval}
    e = _engine()
    assert tasks.publisher.flush(timeout=10)
    time.sleep(interval)  # a quiet spell
    batches = _batches(monkeypatch)

    def start(n: int) -> str:
        return e.start("test.add", add_input(f"c{n}")).run_id

    def waits() -> None:
        chain.append(start(len(chain)))
        assert not tasks.publisher.flush(timeout=interval / 8), f"message {len(chain) - 1} of the chain went at once"
        assert tasks.publisher.flush(timeout=10)  # nothing came meanwhile

    chain = [start(0)]
    assert tasks.publisher.flush(timeout=interval / 2)  # after a quiet spell: at once
    for _ in range(publishing.IDLE_WAITS):  # right after a batch: each waits, and gathers nothing
        waits()
    for _ in range(publishing.AT_ONCE_AFTER_IDLE_WAITS):
        chain.append(start(len(chain)))
        assert tasks.publisher.flush(timeout=interval / 2), f"message {len(chain) - 1} of the chain waited"
    waits()  # then they wait again
    assert [ids for _, ids in batches] == [[run_id] for run_id in chain]
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in chain)


def test_with_no_interval_a_message_right_after_a_batch_goes_at_once(
    queue: str, settings: Any, through_the_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": 0}
    slept: list[float] = []
    sleep = time.sleep

    def recorded(seconds: float) -> None:
        if threading.current_thread() is tasks.publisher._thread:
            slept.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(publishing.time, "sleep", recorded)
    e = _engine()
    batches = _batches(monkeypatch)
    first = e.start("test.add", add_input("z0")).run_id
    assert tasks.publisher.flush(timeout=10)
    second = e.start("test.add", add_input("z1")).run_id  # right after a batch
    assert tasks.publisher.flush(timeout=10)
    assert [ids for _, ids in batches] == [[first], [second]]
    assert slept == []  # the default interval would have made the thread wait for the second
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in (first, second))


def test_a_misconfigured_interval_gives_the_default_and_never_stops_the_publisher(
    queue: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": "5ms"}
    assert conf.publish_batch_interval() == conf.Defaults.PUBLISH_BATCH_INTERVAL
    batches = _batches(monkeypatch)
    run_ids = [_engine().start("test.add", add_input(f"m{n}")).run_id for n in range(3)]
    assert tasks.publisher.flush(timeout=10)
    assert sorted(run_id for _, ids in batches for run_id in ids) == sorted(run_ids)
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in run_ids)


def test_an_eager_celery_app_executes_the_run_before_the_start_returns(settings: Any) -> None:
    settings.CELERY_TASK_ALWAYS_EAGER = True
    assert celery_app.conf.task_always_eager
    handle = engine.start("test.add", add_input("k"))
    assert models.WorkflowRun.objects.get(run_id=handle.run_id).status == "completed"


_SCRIPT = """
import os, sys, time
import django
django.setup()
from celery import signals
from durable import Engine, InMemoryStore, tasks
from durable.tasks import CeleryDispatcher
from tests import workflows

engine = Engine(InMemoryStore(), dispatch=CeleryDispatcher())

def start(label):
    return engine.start("test.add", {"a": 1, "b": 2, "key": label}).run_id
"""


def _run_script(queue: str, body: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CELERY_BROKER_URL": str(celery_app.conf.broker_url),
        "DURABLE_TASK_QUEUE": queue,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": str(ROOT),
    }
    script = _SCRIPT + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_the_interpreter_exit_publishes_what_is_still_queued(queue: str) -> None:
    done = _run_script(
        queue,
        """
        release = __import__("threading").Event()
        def hold(**kwargs):  # the publisher is held until the script exits
            release.wait()
        signals.before_task_publish.connect(hold, weak=False)
        ids = [start(f"k{i}") for i in range(20)]
        print(tasks.publisher._queue.qsize() > 0)
        import atexit
        atexit.register(release.set)  # runs before durable's own (atexit is last in, first out)
        print(" ".join(ids))
        """,
    )
    pending, run_ids = done.stdout.splitlines()
    assert pending == "True"  # messages were still waiting when the script ended
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in run_ids.split())


def test_a_forked_child_publishes_through_a_publisher_of_its_own(queue: str) -> None:
    done = _run_script(
        queue,
        """
        ids = [start("before-fork")]
        assert tasks.publisher.flush(30)
        parent_thread = tasks.publisher._thread
        pid = os.fork()
        if pid == 0:  # the child: its first start starts its own thread
            code = 1
            try:
                child = start("child")
                ok = tasks.publisher.flush(30)
                own = tasks.publisher._thread is not parent_thread and tasks.publisher._thread.is_alive()
                print(child, flush=True)
                code = 0 if ok and own else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        ids.append(start("after-fork"))
        assert tasks.publisher.flush(30) and tasks.publisher._thread is parent_thread
        print(" ".join(ids))
        """,
    )
    child, parents = done.stdout.splitlines()
    run_ids = [child, *parents.split()]
    assert _ids(_drain(queue)) == sorted(tasks.task_id(run_id, 0) for run_id in run_ids)


# -- direct writes: the caller writes a templated message itself, the thread reads the reply --
@pytest.fixture
def at_once(settings: Any) -> None:
    """Every message goes at once (``PUBLISH_BATCH_INTERVAL`` 0): each one the caller can write,
    it writes, however soon after the last (a message that would wait goes with the thread's batch)."""
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": 0}


def _learned(e: Engine) -> tuple[Any, list[str]]:
    """A new session of the publisher's thread whose template for the test's queue is verified
    and whose direct connection is open: two starts, their messages built by kombu (the first
    gives the template, the second checks it). The session and the two run ids.

    The session of before is retired: its producer no longer the app's, the thread closes it
    and sets up another as it publishes the first of the two (kombu's publish batch is the
    thread's that opened it, so only that thread may close it)."""
    session, learners = _new_session(e)
    assert session.writer is not None and not session.writer.broken
    return session, learners


def _new_session(e: Engine) -> tuple[Any, list[str]]:
    assert tasks.publisher.flush(timeout=10)
    retired = publishing._sessions.get(celery_app)
    if retired is not None:
        retired.pool = None
    learners = [e.start("test.add", add_input(f"learn{n}")).run_id for n in range(2)]
    assert tasks.publisher.flush(timeout=10)
    session = publishing._sessions[celery_app]
    assert session is not retired
    return session, learners


def _task_ids(*run_ids: str) -> list[str]:
    return sorted(tasks.task_id(run_id, 0) for run_id in run_ids)


@pytest.mark.usefixtures("at_once")
def test_once_a_template_is_verified_the_caller_writes_the_message_before_the_start_returns(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = _engine()
    session, learners = _learned(e)
    batches = _batches(monkeypatch)
    reading, release = threading.Event(), threading.Event()
    collect = publishing._collect

    def held(pacing: Any, everything: bool) -> Any:  # the thread, come to read the replies, is held
        reading.set()
        release.wait(30)
        return collect(pacing, everything)

    monkeypatch.setattr(publishing, "_collect", held)
    client = redis.Redis.from_url(str(celery_app.conf.broker_url))
    run_ids = []
    try:
        for n in range(3):
            run_ids.append(e.start("test.add", add_input(f"d{n}")).run_id)
            assert client.llen(queue) == len(learners) + n + 1  # in Redis when the start returned
        assert reading.wait(10)
        assert list(session.writer.written) != [] and not tasks.publisher.flush(timeout=0.2)
    finally:
        release.set()
        client.close()
    assert tasks.publisher.flush(timeout=10)  # the replies read: flush waits for them
    assert not session.writer.written and not session.writer.signalled
    assert batches == []  # the thread published none of the three
    assert _ids(_drain(queue)) == _task_ids(*learners, *run_ids)


@pytest.mark.usefixtures("at_once")
def test_the_thread_reads_the_replies_of_many_writes_at_once_and_without_a_flush(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages written a few milliseconds apart: the thread reads their replies together,
    ``COLLECT_INTERVAL`` after the first was written (a wake-up each, not one a message),
    and with no flush to ask for them."""
    monkeypatch.setattr(publishing, "COLLECT_INTERVAL", 0.5)  # long beside the ten starts, even on a slow machine
    e = _engine()
    session, learners = _learned(e)
    readings: list[int] = []
    collect = publishing._collect

    def counted(pacing: Any, everything: bool) -> Any:
        readings.append(len(session.writer.written))
        return collect(pacing, everything)

    monkeypatch.setattr(publishing, "_collect", counted)
    run_ids = []
    for n in range(10):
        run_ids.append(e.start("test.add", add_input(f"c{n}")).run_id)
        time.sleep(0.003)  # more than DIRECT_WRITES_APART: each written by its caller
    deadline = time.monotonic() + 10
    while session.writer.written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not session.writer.written and not session.writer.signalled  # read, unasked
    assert 1 <= len(readings) <= 2 and sum(readings) >= 10, readings
    assert _ids(_drain(queue)) == _task_ids(*learners, *run_ids)


@pytest.mark.usefixtures("at_once")
def test_a_message_the_caller_writes_is_the_text_kombu_writes(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = _engine()
    _learned(e)
    _texts([queue])
    run_id = e.start("test.add", add_input("t")).run_id
    assert tasks.publisher.flush(timeout=10)
    [written] = _texts([queue])[queue]
    m = publishing._Message(celery_app, run_id, tasks.task_id(run_id, 0), queue, None, None, None)
    with monkeypatch.context() as patched:
        patched.setattr(publishing._Session, "template", lambda self, destination: None)
        publishing._publish(celery_app, [m])
    [kombus] = _texts([queue])[queue]
    assert _untagged(written) == _untagged(kombus)


def test_with_a_global_key_prefix_the_caller_writes_to_kombus_key(queue: str) -> None:
    options = {"global_keyprefix": "prefixed:"}
    with _app("durable-direct-prefix", broker_url=celery_app.conf.broker_url, broker_transport_options=options) as app:
        publishing._publish(app, _messages(app, 2, queue))  # a template, checked; the writer opens
        session = publishing._sessions[app]
        assert session.writer is not None and session.prefix == "prefixed:"
        _texts([f"prefixed:{queue}"])
        [m] = _messages(app, 1, queue)
        assert session.write(m, lambda: None)
        assert session.collect(everything=True) == ([], False)  # the reply read: confirmed
        [text] = _texts([f"prefixed:{queue}"])[f"prefixed:{queue}"]
        assert json.loads(text)["headers"]["id"] == m.task_id


@pytest.mark.usefixtures("at_once")
def test_a_message_redis_refuses_on_the_direct_connection_goes_through_kombu(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = _engine()
    session, learners = _learned(e)
    client = redis.Redis.from_url(str(celery_app.conf.broker_url))
    try:
        client.set(f"refused:{queue}", "not a list")
        monkeypatch.setattr(session, "prefix", "refused:")  # each LPUSH gets WRONGTYPE
        run_ids = [e.start("test.add", add_input(f"r{n}")).run_id for n in range(3)]
        assert tasks.publisher.flush(timeout=10)
        assert client.get(f"refused:{queue}") == b"not a list"
    finally:
        client.delete(f"refused:{queue}")
        client.close()
    assert session.writer is not None and not session.writer.broken  # an error reply is no broken connection
    assert _ids(_drain(queue)) == _task_ids(*learners, *run_ids)


@pytest.mark.usefixtures("at_once")
def test_a_direct_connection_lost_loses_no_message_and_another_is_opened(
    queue: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(publishing, "WRITER_AGAIN_AFTER", 0.0)
    caplog.set_level(logging.INFO, logger="durable.tasks")
    e = _engine()
    session, learners = _learned(e)
    lost = session.writer
    host, port = lost.sock.getsockname()[:2]
    client = redis.Redis.from_url(str(celery_app.conf.broker_url))
    try:
        assert client.client_kill(f"{host}:{port}")  # as a restart or a proxy would
    finally:
        client.close()
    run_ids = [e.start("test.add", add_input(f"k{n}")).run_id for n in range(5)]
    assert tasks.publisher.flush(timeout=10)
    assert lost.broken and session.writer is not lost
    assert "the direct connection to the broker failed" in caplog.text
    after = [e.start("test.add", add_input(f"a{n}")).run_id for n in range(3)]
    assert tasks.publisher.flush(timeout=10)
    assert session.writer is not None and session.writer is not lost and not session.writer.broken
    # Each run's message is there; one that reached Redis before the reply was lost may be there twice.
    sent = _ids(_drain(queue))
    assert sorted(set(sent)) == _task_ids(*learners, *run_ids, *after)


class _Half:
    """A socket that takes half of what is sent at once (as a full send buffer would)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def send(self, data: bytes, flags: int = 0) -> int:
        return int(self.sock.send(data[: len(data) // 2], flags))


@pytest.mark.usefixtures("at_once")
def test_a_write_the_socket_does_not_take_whole_goes_through_the_thread(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publishing, "WRITER_AGAIN_AFTER", 0.0)
    e = _engine()
    session, learners = _learned(e)
    half = session.writer
    monkeypatch.setattr(half, "sock", _Half(half.sock))
    batches = _batches(monkeypatch)
    cut = e.start("test.add", add_input("cut")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert half.broken and [ids for _, ids in batches] == [[cut]]  # the thread published it through kombu
    again = e.start("test.add", add_input("again")).run_id  # on the connection opened since
    assert tasks.publisher.flush(timeout=10)
    assert session.writer is not half and [ids for _, ids in batches] == [[cut]]
    # Redis dropped the half command with its connection: each message once.
    assert _ids(_drain(queue)) == _task_ids(*learners, cut, again)


@pytest.mark.usefixtures("at_once")
def test_many_threads_writing_at_once_each_run_gets_exactly_one_message(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = _engine()
    session, learners = _learned(e)
    batches = _batches(monkeypatch)
    run_ids = _started_from_many_threads("w")
    assert batches == []  # every message written by its caller's thread
    assert not session.writer.written and not session.writer.broken
    assert _ids(_drain(queue)) == _task_ids(*learners, *run_ids)


def test_a_forked_child_never_writes_on_the_parents_direct_connection(queue: str) -> None:
    done = _run_script(
        queue,
        """
        ids = [start("learn0"), start("learn1")]
        assert tasks.publisher.flush(30)
        app = tasks.execute_run.app
        writer = tasks.publishing._sessions[app].writer
        assert writer is not None
        pid = os.fork()
        if pid == 0:  # the child: a session of its own, its parent's connection forgotten
            code = 1
            try:
                child = start("child")
                ok = tasks.publisher.flush(30) and tasks.publishing._sessions[app].writer is not writer
                print(child, flush=True)
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        import gc
        gc.collect()
        ids += [start("after-fork0"), start("after-fork1")]
        assert tasks.publisher.flush(30)
        session = tasks.publishing._sessions[app]
        assert session.writer is writer and not writer.broken and not writer.written, "the parent's connection"
        print(" ".join(ids))
        """,
    )
    child, parents = done.stdout.splitlines()
    assert _ids(_drain(queue)) == _task_ids(child, *parents.split())


@pytest.mark.usefixtures("at_once")
def test_a_direct_connection_that_cannot_be_opened_is_tried_again_later_and_no_message_waits_for_it(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[float] = []

    def refused(channel: Any) -> None:
        attempts.append(time.monotonic())
        raise ConnectionError("connection refused")

    with monkeypatch.context() as patched:
        patched.setattr(publishing.DirectWriter, "open", refused)
        e = _engine()
        session, learners = _new_session(e)
        assert attempts and session.writer is None and session.writer_failures == 1
        # The next try waits twice WRITER_AGAIN_AFTER; the thread publishes meanwhile.
        assert session.writer_at - attempts[-1] == pytest.approx(2 * publishing.WRITER_AGAIN_AFTER, abs=0.1)
        meanwhile = [e.start("test.add", add_input(f"m{n}")).run_id for n in range(3)]
        assert tasks.publisher.flush(timeout=10)
        assert len(attempts) == 1 and session.writer is None
    session.writer_at = 0.0  # as if the wait was over: the next batch opens it
    opening = e.start("test.add", add_input("o")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert session.writer is not None and session.writer_failures == 0
    written = e.start("test.add", add_input("w")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert _ids(_drain(queue)) == _task_ids(*learners, *meanwhile, opening, written)


def test_messages_that_come_fast_go_with_the_threads_batch_and_one_after_a_quiet_spell_is_written(
    queue: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message the caller writes itself, unless it comes less than ``DIRECT_WRITES_APART`` after
    the process's last one (a process starting runs fast): then it waits in the thread, for the rest
    of ``PUBLISH_BATCH_INTERVAL`` since the last message went, and goes out with the others in one
    pipeline: less CPU a message than a write each."""
    interval = 1.0
    settings.DURABLE = {**settings.DURABLE, "PUBLISH_BATCH_INTERVAL": interval}
    monkeypatch.setattr(publishing, "DIRECT_WRITES_APART", interval / 2)  # the starts below are far closer
    e = _engine()
    session, learners = _learned(e)
    time.sleep(interval)  # a quiet spell
    batches = _batches(monkeypatch)
    written = e.start("test.add", add_input("q")).run_id
    burst = [e.start("test.add", add_input(f"b{n}")).run_id for n in range(4)]
    assert tasks.publisher.flush(timeout=10)
    assert [ids for _, ids in batches] == [burst]  # the first was written by its caller
    time.sleep(interval)
    alone = e.start("test.add", add_input("a")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert [ids for _, ids in batches] == [burst] and not session.writer.written
    assert _ids(_drain(queue)) == _task_ids(*learners, written, *burst, alone)


def test_celerys_part_of_the_message_is_the_same_whichever_thread_reads_it_again(queue: str) -> None:
    """``app_conf`` is read again every second by whichever thread asks first (a caller, or the
    publisher's thread): what it makes a message from must not depend on the thread (Celery's
    ``thread_oid``), or each such read would throw the templates away."""
    e = _engine()
    session, learners = _learned(e)
    publishing._app_confs.clear()
    started(lambda: publishing.app_conf(celery_app)).outcome()  # read again on a thread of its own
    run_id = e.start("test.add", add_input("r")).run_id
    assert tasks.publisher.flush(timeout=10)
    assert [t.verified for t in _templates(session, queue)] == [True]
    assert _ids(_drain(queue)) == _task_ids(*learners, run_id)
