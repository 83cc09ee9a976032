"""Django signals: what an operator's code can react to (see the reference page "Django signals").

Each is sent once per event, after the state change it reports has committed
(``transaction.on_commit``): a change rolled back sends nothing. Receivers are
called with ``send_robust``: a receiver that raises is logged at ERROR and
never fails the run, the start or the firing that sent the signal. When no
receiver is connected, the engine does not even build the arguments.

- ``run_started``: a worker claimed a run for its first execution.
- ``run_finished``: a run reached a terminal status.
- ``step_finished``: a ``ctx.step`` finished (completed, or failed after its retries).
- ``start_refused``: a quota refused a start (``ConcurrencyLimitError``).
- ``window_skipped``: a schedule's firing started nothing because of a quota.

``_run_created`` is internal (it feeds ``durable.contrib.prometheus``'s start
counters) and may change without notice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger(__name__)

#: sender: the ``Engine``; run_id, workflow, version, namespace, attempt, started_at.
run_started = Signal()
#: sender: the ``Engine``; run_id, workflow, version, namespace, status, output,
#: error, started_at, finished_at, duration.
run_finished = Signal()
#: sender: the ``Engine``; run_id, workflow, namespace, step, position, outcome,
#: attempts, output, error, started_at, finished_at, duration.
step_finished = Signal()
#: sender: the ``Engine``; workflow, key, limit, active, namespace, run_id, error.
start_refused = Signal()
#: sender: the ``Schedule`` model; schedule, window, run_id, reason, manual, error.
window_skipped = Signal()
#: Internal: a start created its run. sender: the ``Engine``; run_id, workflow,
#: namespace, status (``pending``, ``queued`` or ``cancelled``).
_run_created = Signal()

_NAMES = {
    id(run_started): "run_started",
    id(run_finished): "run_finished",
    id(step_finished): "step_finished",
    id(start_refused): "start_refused",
    id(window_skipped): "window_skipped",
    id(_run_created): "_run_created",
}


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Call every receiver of ``signal``; log (never raise) a receiver's exception."""
    for receiver, result in signal.send_robust(sender, **kwargs):
        if isinstance(result, Exception):
            logger.error(
                "A receiver of durable's %s signal failed (%r); the run goes on as if it had not been called.",
                _NAMES.get(id(signal), "?"),
                receiver,
                exc_info=result,
            )


def send_on_commit(on_commit: Callable[[Callable[[], object]], None], signal: Signal, sender: Any, **kwargs: Any) -> None:
    """``send`` once the current transaction commits (``on_commit``: the store's)."""
    on_commit(lambda: send(signal, sender, **kwargs))
