"""The house's walls, read from the source with ``ast``: durable's modules import
each other without a cycle, the engine (``durable/runtime/``) knows no Celery, and
talks to stores and dispatchers only through their stated contracts
(``BaseStore``, ``Dispatcher``), never by probing for a capability."""

from __future__ import annotations

import ast
from pathlib import Path

from durable.runtime.dispatch import Dispatcher
from durable.stores.base import BaseStore

PACKAGE = Path(__file__).resolve().parents[2] / "durable"
RUNTIME = PACKAGE / "runtime"
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


def module_graph() -> dict[str, set[str]]:
    """Which of durable's modules each one imports (at module level or inside a
    function; not under ``if TYPE_CHECKING:``, not migrations). An import of a
    package names its ``__init__``, which only re-exports: those edges are left out,
    as a package is not a module with behaviour of its own."""
    paths = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts
    }
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        if name in packages:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        base = name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: make it absolute
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                node = ast.ImportFrom(module=".".join(anchor + [node.module or ""]).rstrip("."), names=node.names)
            for imported in imported_modules(ast.Module(body=[node], type_ignores=[])):
                while imported and imported not in paths:
                    imported = imported.rpartition(".")[0]
                if imported and imported != name and imported not in packages:
                    targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]``."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        path.append(module)
        for target in sorted(graph.get(module, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return []


def test_durable_has_no_import_cycle() -> None:
    graph = module_graph()
    assert {"durable.models", "durable.tasks.sending", "durable.runtime.engine", "durable.schedules.firing"} <= set(graph)
    assert "durable.runtime.starting" in graph["durable.runtime.engine"]
    # The graph sees real imports, function-local ones included.
    assert "durable.runtime.dispatch" in graph["durable.tasks.sending"]
    assert "durable.tasks.workers" in graph["durable.tasks.publishing"]
    assert "durable.models" in graph["durable.stores.orm"]
    assert find_cycle(graph) == []


def test_the_cycle_check_finds_the_cycle_this_issue_removed() -> None:
    before = {
        "durable.models": {"durable.schedules"},
        "durable.schedules": {"durable.runtime.core"},
        "durable.runtime.core": {"durable.tasks"},
        "durable.tasks": {"durable.schedules"},
    }
    assert find_cycle(before) == ["durable.schedules", "durable.runtime.core", "durable.tasks", "durable.schedules"]
    assert find_cycle({**before, "durable.tasks": set()}) == []


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
