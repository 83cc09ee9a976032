"""Run the django-tasks backport's own generic backend tests against DurableBackend.

Their tests live in their repository, not in the sdist, and are not copied here:
this script runs them from a checkout (a clone or ``git archive`` of the release
tag matching the installed django-tasks, 0.12.0)::

    DJANGO_TASKS_CHECKOUT=/path/to/django-tasks .venv/bin/python tests/peer/run_django_tasks.py [--json] [--store=django]

It configures Django with their test settings (plus durable's apps), and every
backend their tests configure as ``ImmediateBackend`` is built as a
``DurableBackend`` instead, on an engine that executes each run in the caller's
thread at enqueue (``InlineDispatcher``), on ``InMemoryStore`` by default (their
tests are ``SimpleTestCase``s, which may not touch a database), or with
``--store=django`` on ``DjangoStore`` over a migrated SQLite test database (the
test classes are then allowed the database). So the tests written for the
immediate backend, where a task has run when ``enqueue`` returns, exercise
DurableBackend's enqueue, execution, results, errors, signals and validation.

The tests that do not apply (they assert the ImmediateBackend class itself, or a
capability durable has on purpose) are listed in ``NOT_APPLICABLE`` with the reason;
they still run, and are reported apart. Exit status 0 when every applicable test passes.
"""

from __future__ import annotations

import json
import os
import sys
import unittest
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The modules of their suite whose tests are about a backend or the Task API
#: (test_dummy_backend tests the dummy backend's own result list, test_custom_backend
#: a backend class of theirs, test_utils and test_compat helpers of the package).
MODULES = ["tests.tests.test_immediate_backend", "tests.tests.test_tasks"]
IMMEDIATE = "django_tasks.backends.immediate.ImmediateBackend"
#: How many calls the current test made into a DurableBackend (validate, enqueue, results, checks).
CALLS = [0]
#: The engine the swapped backends start runs on (set by ``configure``).
ENGINES: list[Any] = []

#: test id -> why it does not apply to DurableBackend.
NOT_APPLICABLE = {
    "tests.tests.test_immediate_backend.ImmediateBackendTestCase.test_using_correct_backend": (
        "asserts that the backend is an ImmediateBackend instance"
    ),
    "tests.tests.test_immediate_backend.ImmediateBackendTestCase.test_cannot_pass_run_after": (
        "asserts that run_after is refused: DurableBackend supports it (supports_defer = True)"
    ),
    "tests.tests.test_immediate_backend.ImmediateBackendTestCase.test_cannot_get_result": (
        "asserts that get_result is not supported: DurableBackend supports it (supports_get_result = True)"
    ),
    "tests.tests.test_immediate_backend.ImmediateBackendTestCase.test_cannot_refresh_result": (
        "asserts that refresh is not supported: DurableBackend supports it (supports_get_result = True)"
    ),
    "tests.tests.test_immediate_backend.ImmediateBackendTestCase.test_get_result_from_different_request": (
        "asserts that a result cannot be fetched from another request: DurableBackend can (supports_get_result = True)"
    ),
    "tests.tests.test_tasks.TaskTestCase.test_get_backend": "asserts that the backend is an ImmediateBackend instance",
}


def configure(checkout: Path, store: str) -> None:
    sys.path.insert(0, str(checkout))  # their `tests` package, before anything named so
    import django
    from django.conf import settings

    from tests import settings as theirs  # type: ignore[import-not-found]

    values = {name: getattr(theirs, name) for name in dir(theirs) if name.isupper()}
    values["INSTALLED_APPS"] = [*values["INSTALLED_APPS"], "django_celery_beat", "rest_framework", "durable"]
    values["DATABASES"] = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:", "OPTIONS": {"transaction_mode": "IMMEDIATE"}}
    }
    values["DEFAULT_AUTO_FIELD"] = "django.db.models.BigAutoField"
    settings.configure(**values)
    django.setup()
    _swap_immediate_backend(store)


def _swap_immediate_backend(store: str) -> None:
    """Every TASKS entry naming ImmediateBackend is built as a DurableBackend on the inline engine."""
    import django_tasks

    from durable import DjangoStore, Engine, InMemoryStore
    from durable.contrib.tasks import DurableBackend
    from durable.runtime.dispatch import InlineDispatcher

    engine = Engine(DjangoStore() if store == "django" else InMemoryStore(), dispatch=InlineDispatcher())
    ENGINES.append(engine)

    class InlineDurableBackend(DurableBackend):
        """DurableBackend; its engine executes each run in the caller's thread."""

        def __init__(self, alias: str, params: dict[str, Any]) -> None:
            super().__init__(alias, params)
            self._engine = engine

    def counted(name: str) -> None:
        method = getattr(DurableBackend, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            CALLS[0] += 1
            return method(self, *args, **kwargs)

        async def acall(self: Any, *args: Any, **kwargs: Any) -> Any:
            CALLS[0] += 1
            return await method(self, *args, **kwargs)

        setattr(InlineDurableBackend, name, acall if name.startswith("a") else call)

    for name in ("validate_task", "enqueue", "aenqueue", "get_result", "aget_result", "check"):
        counted(name)

    original = django_tasks.TaskBackendHandler.create_connection

    def create_connection(self: Any, alias: str) -> Any:
        params = self.settings[alias]
        if params.get("BACKEND") == IMMEDIATE:
            return InlineDurableBackend(alias=alias, params=params)
        return original(self, alias)

    django_tasks.TaskBackendHandler.create_connection = create_connection  # type: ignore[method-assign]
    from durable.contrib.tasks import backend

    backend.register(engine)


class _Result(unittest.TextTestResult):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        #: The tests that called into DurableBackend (the others test the framework on its dummy backend).
        self.exercised: set[str] = set()

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802  (unittest's names)
        CALLS[0] = 0
        super().startTest(test)

    def stopTest(self, test: unittest.TestCase) -> None:  # noqa: N802
        if CALLS[0]:
            self.exercised.add(test.id())
        super().stopTest(test)

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addSuccess(test)
        self.outcomes.setdefault(test.id(), "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addFailure(test, err)
        self.outcomes[test.id()] = "failed"

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self.outcomes[test.id()] = "failed"

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self.outcomes[test.id()] = "skipped"

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:  # noqa: N802
        super().addSubTest(test, subtest, err)
        if err is not None:
            self.outcomes[test.id()] = "failed"


def _cases(suite: unittest.TestSuite) -> list[unittest.TestCase]:
    cases: list[unittest.TestCase] = []
    for item in suite:
        cases += _cases(item) if isinstance(item, unittest.TestSuite) else [item]
    return cases


def run(as_json: bool, store: str) -> int:
    from django.test.utils import setup_databases, setup_test_environment

    setup_test_environment()
    suite = unittest.defaultTestLoader.loadTestsFromNames(MODULES)
    if store == "django":
        setup_databases(verbosity=0, interactive=False)
        for case in _cases(suite):
            type(case).databases = {"default"}  # type: ignore[attr-defined]  (runs are rows now)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1 if as_json else 2, resultclass=_Result)
    result: Any = runner.run(suite)
    outcomes: dict[str, str] = result.outcomes
    # A test applies when it calls into DurableBackend and is not listed as not applying; the
    # others of test_tasks.py test the framework on its dummy backend (they must pass all the same).
    applicable = {t: o for t, o in outcomes.items() if t in result.exercised and t not in NOT_APPLICABLE}
    elsewhere = {t: o for t, o in outcomes.items() if t not in result.exercised and t not in NOT_APPLICABLE}
    summary = {
        "store": store,
        "task_runs": len(ENGINES[0].list_runs(workflow="durable.task")),
        "modules": MODULES,
        "ran": len(outcomes),
        "applicable": len(applicable),
        "passed": sum(o == "passed" for o in applicable.values()),
        "applying": sorted(applicable),
        "failed": sorted(t for t, o in {**applicable, **elsewhere}.items() if o == "failed"),
        "skipped": sorted(t for t, o in applicable.items() if o == "skipped"),
        "not_calling_durable": len(elsewhere),
        "not_calling_durable_passed": sum(o == "passed" for o in elsewhere.values()),
        "not_applicable": {t: {"reason": r, "outcome": outcomes.get(t, "not run")} for t, r in NOT_APPLICABLE.items()},
    }
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"\nRan {summary['ran']} tests of {', '.join(MODULES)} ({store} store). {summary['passed']} of the "
            f"{summary['applicable']} that apply (they call into DurableBackend) passed; "
            f"{summary['not_calling_durable_passed']} of the {summary['not_calling_durable']} that test the "
            f"framework on its dummy backend passed; {len(NOT_APPLICABLE)} do not apply:"
        )
        for test, reason in NOT_APPLICABLE.items():
            print(f"  {test}: {reason}")
        for test in summary["failed"]:
            print(f"  FAILED {test}")
    return 0 if not summary["failed"] else 1


def main() -> int:
    checkout = os.environ.get("DJANGO_TASKS_CHECKOUT")
    if not checkout or not (Path(checkout) / "tests" / "tests" / "test_immediate_backend.py").exists():
        print("Set DJANGO_TASKS_CHECKOUT to a checkout of django-tasks (the tag of the installed version).", file=sys.stderr)
        return 2
    store = "django" if "--store=django" in sys.argv[1:] else "memory"
    configure(Path(checkout).resolve(), store)
    return run("--json" in sys.argv[1:], store)


if __name__ == "__main__":
    sys.exit(main())
