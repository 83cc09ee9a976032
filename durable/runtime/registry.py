"""Which workflows exist: name -> version -> definition."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durable import concurrency, exceptions

WorkflowFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Definition:
    name: str
    version: str
    fn: WorkflowFn
    concurrency: tuple[concurrency.Concurrency, ...] = ()


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[str, dict[str, Definition]] = {}
        self._current: dict[str, str] = {}

    def register(
        self,
        name: str,
        version: str,
        fn: WorkflowFn,
        concurrency_spec: concurrency.ConcurrencySpec = None,
    ) -> Definition:
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ValueError(f"A workflow name must be a non-empty string of at most 255 characters, got {name!r}.")
        if not isinstance(version, str) or not version or len(version) > 64:
            raise ValueError(f"A workflow version must be a non-empty string of at most 64 characters, got {version!r}.")
        if not callable(fn):
            raise TypeError(f"The body of workflow {name!r} must be callable, got {fn!r}.")
        definition = Definition(name, version, fn, concurrency.normalize(concurrency_spec))
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

    def unregister(self, name: str) -> None:
        with self._lock:
            self._versions.pop(name, None)
            self._current.pop(name, None)


#: The registry every engine shares unless given its own.
default_registry = Registry()
