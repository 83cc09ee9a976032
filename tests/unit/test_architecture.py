"""The house's walls, read from the source with ``ast``: the engine (``durable/runtime/``)
knows no Celery, and talks to stores and dispatchers only through their stated
contracts (``BaseStore``, ``Dispatcher``), never by probing for a capability."""

from __future__ import annotations

import ast
from pathlib import Path

from durable.runtime.dispatch import Dispatcher
from durable.stores.base import BaseStore

RUNTIME = Path(__file__).resolve().parents[2] / "durable" / "runtime"
#: Every capability a store or a dispatcher states: a probe for one is a contract left unstated.
CAPABILITIES = {name for cls in (BaseStore, Dispatcher) for name in vars(cls) if not name.startswith("_")}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text(), filename=str(path))) for path in sorted(RUNTIME.glob("*.py"))]


def imported_modules(tree: ast.Module) -> list[str]:
    """Every module an ``import`` names, at module level or inside a function
    (``from durable import tasks`` names ``durable.tasks``)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def capability_probes(tree: ast.Module) -> list[str]:
    """``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` where ``name`` is a
    store or dispatcher capability, as ``func:name``."""
    probes = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CAPABILITIES
        ):
            probes.append(f"{node.func.id}:{node.args[1].value}")
    return probes


def test_the_runtime_imports_neither_celery_nor_the_tasks() -> None:
    found = [
        f"{name}: {module}"
        for name, tree in _modules()
        for module in imported_modules(tree)
        if module.split(".")[0] in ("celery", "kombu") or module == "durable.tasks" or module.startswith("durable.tasks.")
    ]
    assert found == []


def test_the_runtime_probes_no_store_or_dispatcher_capability() -> None:
    found = [f"{name}: {probe}" for name, tree in _modules() for probe in capability_probes(tree)]
    assert found == []


def test_the_contracts_state_the_capabilities_the_engine_used_to_probe() -> None:
    # Those the engine once asked for with getattr: now stated, with their defaults.
    assert {"admit", "run_exists", "count_runs", "recover", "release_thread", "waiting_parents"} <= CAPABILITIES
    assert {"send", "revoke", "wake_later", "live_queues"} <= CAPABILITIES


def test_the_checks_catch_what_they_look_for() -> None:
    """Both checks find the code this issue removed (as it stood in ``core.py`` and ``execution.py``)."""
    before = ast.parse(
        "def revoke(self, engine, run):\n"
        "    from durable import tasks\n"
        "    import celery.app\n"
        "def count(self):\n"
        "    count_runs = getattr(self.store, 'count_runs', None)\n"
        "    ask = getattr(self.engine.dispatch, 'live_queues', None)\n"
        "    name = getattr(workflow, 'name', None)\n"
    )
    assert imported_modules(before) == ["durable", "durable.tasks", "celery.app"]
    assert capability_probes(before) == ["getattr:count_runs", "getattr:live_queues"]
