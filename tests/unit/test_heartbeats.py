"""The heartbeats of the executions in flight: one thread per process beats them all, each
every HEARTBEAT_INTERVAL (0.2 s in the tests), and tells an execution when its run is no
longer its lease's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from durable import Engine, InMemoryStore, RunStatus
from durable.runtime import Registry
from durable.testing import wait_for


class CountingStore(InMemoryStore):
    """Records each heartbeat (the run and the monotonic time); ``fail`` beats raise."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__()
        self.beats: list[tuple[str, float]] = []
        self.fail = fail
        self.released = 0

    def heartbeat(self, run_id: str, lease: str) -> bool:
        self.beats.append((run_id, time.monotonic()))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the database went away")
        return super().heartbeat(run_id, lease)

    def release_thread(self) -> None:
        self.released += 1


def _engine(store: InMemoryStore, hold: threading.Event, entered: threading.Event) -> Engine:
    engine = Engine(store, dispatch=lambda engine, run: None, registry=Registry())

    def wait() -> str:
        entered.set()
        assert hold.wait(30)
        return "done"

    engine.register("w", "1", lambda ctx, input: ctx.step("wait", wait))
    return engine


@contextmanager
def _executing(engine: Engine, run_id: str, hold: threading.Event, entered: threading.Event) -> Iterator[None]:
    """Execute the run in a thread; the block runs while its step waits for ``hold``."""
    thread = threading.Thread(target=engine.execute, args=(run_id,))
    thread.start()
    try:
        assert entered.wait(10)
        yield
    finally:
        hold.set()
        thread.join(10)


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("durable-heartbeat")]


def test_one_thread_beats_every_execution_in_flight_each_interval() -> None:
    store, hold = CountingStore(), threading.Event()
    entered = [threading.Event() for _ in range(4)]
    engines = [_engine(store, hold, e) for e in entered]
    handles = [engine.start("w") for engine in engines]
    executions = [threading.Thread(target=e.execute, args=(h.run_id,)) for e, h in zip(engines, handles, strict=True)]
    for thread in executions:
        thread.start()
    try:
        for event in entered:
            assert event.wait(10)
        time.sleep(1.1)  # about five intervals
        assert _threads() == ["durable-heartbeats"]
    finally:
        hold.set()
        for thread in executions:
            thread.join(10)
    for handle in handles:
        assert handle.result(timeout=5) == "done"
        times = [at for run_id, at in store.beats if run_id == handle.run_id]
        assert len(times) >= 4, times
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) < 0.2 * 2, gaps  # each interval, not each pass of a slow beat
    assert store.released >= 4  # the thread holds no connection between passes
    assert _threads() == ["durable-heartbeats"]  # none started per execution, none left over


def test_a_failed_heartbeat_is_tried_again_and_the_run_is_not_lost() -> None:
    store, hold, entered = CountingStore(fail=2), threading.Event(), threading.Event()
    engine = _engine(store, hold, entered)
    handle = engine.start("w")
    with _executing(engine, handle.run_id, hold, entered):
        wait_for(lambda: len(store.beats) >= 4, timeout=5, what="beats after the failures")
        assert store.fail == 0
        heartbeat_at = store.get_run(handle.run_id).heartbeat_at
        wait_for(lambda: store.get_run(handle.run_id).heartbeat_at > heartbeat_at, timeout=5, what="a beat that lands")
    assert handle.result(timeout=5) == "done"


def test_a_run_no_longer_the_leases_is_told_and_beaten_no_more() -> None:
    store, hold, entered = CountingStore(), threading.Event(), threading.Event()
    engine = _engine(store, hold, entered)
    handle = engine.start("w")
    with _executing(engine, handle.run_id, hold, entered):
        engine.cancel(handle.run_id)
        wait_for(lambda: len(store.beats) >= 1, timeout=5, what="a heartbeat after the cancel")
        time.sleep(0.6)
        beats = len(store.beats)
        time.sleep(0.6)
        assert len(store.beats) == beats  # the lost run is dropped from the passes
    assert store.get_run(handle.run_id).status == RunStatus.CANCELLED
    assert [s.name for s in store.load_steps(handle.run_id)] == []  # told at the step boundary: nothing journaled


def test_an_execution_due_sooner_than_the_threads_next_look_wakes_it(settings: Any) -> None:
    """The thread looks again after an interval when nothing is in flight; an execution added
    with a shorter interval is beaten on its own schedule, not at the thread's next look."""
    settings.DURABLE = {**settings.DURABLE, "HEARTBEAT_INTERVAL": 5.0}
    store, hold, entered = CountingStore(), threading.Event(), threading.Event()
    engine = _engine(store, hold, entered)
    engine.register("quick", "1", lambda ctx, input: None)
    engine.execute(engine.start("quick").run_id)  # the thread runs (it may have been started already)
    time.sleep(0.5)  # idle, it now looks again in about 5 s
    settings.DURABLE = {**settings.DURABLE, "HEARTBEAT_INTERVAL": 0.05}
    handle = engine.start("w")
    with _executing(engine, handle.run_id, hold, entered):
        wait_for(lambda: len(store.beats) >= 3, timeout=2, what="beats at the short interval")
    assert handle.result(timeout=5) == "done"
