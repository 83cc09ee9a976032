"""``WorkflowContext``: what a workflow body uses to run journaled steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Union

from django.utils import timezone

from durable import exceptions
from durable.stores.base import RunRecord, StepEntry
from durable.util import check_json, describe_error

if TYPE_CHECKING:
    from durable.runtime.core import Engine

logger = logging.getLogger(__name__)

Backoff = Union[float, Callable[[int], float]]


class StepFailedError(exceptions.DurableError):
    """A step failed after its retries; on replay the recorded failure is raised again."""

    code = "step_failed"


class WorkflowContext:
    """Passed to a workflow body as ``ctx``.

    Steps are journaled by position: on replay (after a crash or a restart) a step
    that finished already returns its recorded result and its function is not
    called again. Step names must follow the same order on every execution.
    """

    def __init__(self, engine: Engine, run: RunRecord, lease: str, journal: list[StepEntry]) -> None:
        self.engine = engine
        self.run = run
        self._lease = lease
        self._journal = {step.position: step for step in journal}
        self._position = 0

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def input(self) -> Any:
        return self.run.input

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retries: int = 0,
        backoff: Backoff = 1.0,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once for this run and journal its JSON result.

        ``retries`` more attempts are made after an exception (``FatalError`` is
        never retried), waiting ``backoff * 2**(attempt-1)`` seconds (or
        ``backoff(attempt)`` when it is a function) in between.
        """
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
        position = self._position
        self._position += 1
        recorded = self._journal.get(position)
        if recorded is not None:
            if recorded.name != name:
                raise exceptions.NonDeterminismError(
                    f"Run {self.run_id!r} recorded step {recorded.name!r} at position {position}, "
                    f"but the workflow code now runs step {name!r} there. Deploy the new code under a "
                    "new workflow version so in-flight runs finish on the old one.",
                    position=position,
                    recorded=recorded.name,
                    current=name,
                )
            if recorded.outcome == "completed":
                return recorded.output
            raise StepFailedError(
                f"Step {name!r} failed: {recorded.error.get('message', '')}", step=name, error=recorded.error
            )

        self.engine.ensure_running(self.run_id, self._lease)
        started = timezone.now()
        attempt = 0
        while True:
            attempt += 1
            try:
                output = fn(*args, **kwargs)
                check_json(output, what=f"the result of step {name!r}")
            except exceptions.RunCancelled:
                raise
            except Exception as exc:
                fatal = isinstance(exc, exceptions.FatalError) or isinstance(exc, exceptions.InvalidStartError)
                if fatal or attempt > retries:
                    error = describe_error(exc)
                    self._record(StepEntry(position, name, "failed", error=error, attempts=attempt, started_at=started))
                    raise
                delay = backoff(attempt) if callable(backoff) else float(backoff) * 2 ** (attempt - 1)
                logger.info("Step %r of run %s failed (attempt %d), retrying in %.2fs: %s",
                            name, self.run_id, attempt, delay, exc)  # fmt: skip
                time.sleep(max(0.0, delay))
                self.engine.ensure_running(self.run_id, self._lease)
                continue
            self._record(StepEntry(position, name, "completed", output=output, attempts=attempt, started_at=started))
            return output

    def now(self) -> datetime:
        """The current time, journaled: a replay sees the same value."""
        return datetime.fromisoformat(self.step("durable.now", lambda: timezone.now().isoformat()))

    def _record(self, entry: StepEntry) -> None:
        if not self.engine.store.record_step(self.run_id, self._lease, entry):
            # Cancelled (or taken over after we were presumed dead): stop here.
            raise exceptions.RunCancelled(self.run_id)
