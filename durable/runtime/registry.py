"""Which workflows exist: name -> version -> definition."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from durable import concurrency, exceptions

WorkflowFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Definition:
    name: str
    version: str
    #: The body; None for a remote workflow, whose body runs in another service.
    fn: WorkflowFn | None
    concurrency: tuple[concurrency.Concurrency, ...] = ()
    #: Celery queue of the runs ("" for the default queue).
    queue: str = ""
    #: Event names that start this workflow (``engine.emit``).
    on_events: tuple[str, ...] = ()


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[str, dict[str, Definition]] = {}
        self._current: dict[str, str] = {}

    def register(
        self,
        name: str,
        version: str,
        fn: WorkflowFn | None,
        concurrency_spec: concurrency.ConcurrencySpec = None,
        *,
        queue: str = "",
        on_events: Sequence[str] = (),
    ) -> Definition:
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ValueError(f"A workflow name must be a non-empty string of at most 255 characters, got {name!r}.")
        if not isinstance(version, str) or not version or len(version) > 64:
            raise ValueError(f"A workflow version must be a non-empty string of at most 64 characters, got {version!r}.")
        if fn is None and not queue:
            raise TypeError(f"Workflow {name!r} needs a body, or a queue if it is remote.")
        if fn is not None and not callable(fn):
            raise TypeError(f"The body of workflow {name!r} must be callable, got {fn!r}.")
        if not isinstance(queue, str) or len(queue) > 200:
            raise ValueError(f"A queue name must be a string of at most 200 characters, got {queue!r}.")
        if isinstance(on_events, str) or not all(isinstance(e, str) and e for e in on_events):
            raise ValueError(f"on_events must be a list of event names, got {on_events!r}.")
        definition = Definition(name, version, fn, concurrency.normalize(concurrency_spec), queue, tuple(on_events))
        with self._lock:
            self._versions.setdefault(name, {})[version] = definition
            # The version registered last is the one new runs start on.
            self._current[name] = version
        return definition

    def current(self, name: str) -> Definition:
        try:
            return self._versions[name][self._current[name]]
        except KeyError:
            raise exceptions.UnknownWorkflowError(
                f"No workflow is registered under the name {name!r}. Known workflows: "
                f"{', '.join(sorted(self._versions)) or 'none'}. Is its module in <app>/workflows.py?",
                workflow=name,
            ) from None

    def get(self, name: str, version: str) -> Definition:
        try:
            return self._versions[name][version]
        except KeyError:
            raise exceptions.UnknownWorkflowError(
                f"Workflow {name!r} version {version!r} is not registered in this process.",
                workflow=name,
            ) from None

    def names(self) -> list[str]:
        return sorted(self._versions)

    def subscribers(self, event: str) -> list[Definition]:
        """The current version of every workflow started by ``event``."""
        with self._lock:
            current = [self._versions[name][version] for name, version in sorted(self._current.items())]
        return [d for d in current if event in d.on_events]

    def unregister(self, name: str) -> None:
        with self._lock:
            self._versions.pop(name, None)
            self._current.pop(name, None)


#: The registry every engine shares unless given its own.
default_registry = Registry()
