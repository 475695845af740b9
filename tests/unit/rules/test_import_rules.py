"""Import direction between pdplane's parts, read from the source (ast), never by importing it.

- The connector runs inside vLLM's engine process: it imports only `pdplane.core`, `pdplane.v1`,
  the registry's public client (`pdplane.registry.client`) and itself (plus vLLM, torch, the
  standard library and third-party packages), never FastAPI or the web stack.
- The gateway talks to the scheduler through its public port only (`pdplane.scheduler`, which
  re-exports `pdplane.scheduler.port`), and to the registry through its public client.
- No part imports the command line (`pdplane.cli`) but the command line itself: a command
  passes what it owns (the local fleet's credentials, ...) to the part it runs.
- No import cycles between the modules of one part (`pdplane.gateway.*`, ...), of bench/ (all
  of it, across subjects) or of `tests.support`, counting every import: at module level, inside
  functions and under `TYPE_CHECKING` alike.
- Tests import of bench/ its public modules only (`bench.routing.workloads`,
  `bench.vllm_cpu.ttft_breakdown`, ...), never an underscore helper (`bench._procs`,
  `bench.routing._simfleet`) nor an underscore name of a module; what tests and bench share
  lives in `tests.support`, which imports nothing of bench/. Likewise a bench subject imports of
  another subject its public modules only (`bench.relay.proxies`); bench's top-level underscore
  helpers (`bench._procs`) are for every subject.
- Tests import of other tests only their helper modules: `tests.support` (and under it), a
  folder's `conftest.py` or helper module (`tests/integration/registry/fixtures.py`,
  `tests/integration/gateway/helpers.py`, ...), never a test module (`test_*.py`) nor an
  underscore name of any of them; what two test modules share lives in such a helper module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (ROOT / "services", ROOT / "connector")
#: Packages named from the checkout root: the benchmarks and the tests (with their support).
ROOT_PACKAGES = ("bench", "tests")

#: The connector's pdplane imports: these modules and everything under them.
CONNECTOR_MAY_IMPORT = (
    "pdplane.connector",
    "pdplane.core",
    "pdplane.v1",
    "pdplane.registry.client",
)
#: What the gateway may import of the scheduler and of the registry.
GATEWAY_MAY_IMPORT = {
    "pdplane.scheduler": ("pdplane.scheduler", "pdplane.scheduler.port"),
    "pdplane.registry": ("pdplane.registry.client",),
}
#: Third-party packages the connector must never pull into vLLM's engine process.
CONNECTOR_NEVER = ("fastapi", "starlette", "uvicorn")

#: Known violations, each with why it is allowed for now: (importer, imported) -> reason.
#: The test fails when an entry is no longer needed, so that it is deleted with the fix.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
    ("pdplane.autoscale.local", "pdplane.cli.drain"): "the local actuator drains an instance "
    "with `pdplane drain`'s call; it belongs below both (e.g. the registry's client)",
}

#: Known cycles (sorted module lists), each with why it is allowed for now; the test fails
#: when one is gone, so that its entry is deleted with the fix.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _module_name(path: Path) -> str:
    for source in (*SOURCES, ROOT):
        if path.is_relative_to(source):
            parts = list(path.relative_to(source).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(path)


def _modules() -> dict[str, Path]:
    """Every pdplane module (generated protobuf code excluded), every bench/ and tests/ module,
    by dotted name."""
    found = {}
    tops = [source / "pdplane" for source in SOURCES] + [ROOT / p for p in ROOT_PACKAGES]
    for top in tops:
        for path in top.rglob("*.py"):
            name = _module_name(path)
            if not name.startswith("pdplane.v1") and "__pycache__" not in path.parts:
                found[name] = path
    return found


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """Every module `tree` imports, as dotted names. `from a import b` yields `a`, and `a.b`
    too when that is a module of ours or a private name (`_b`); relative imports are resolved
    against `module`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            yield base
            for alias in node.names:
                if f"{base}.{alias.name}" in known or alias.name.startswith("_"):
                    yield f"{base}.{alias.name}"


def _graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Importer -> imported modules; `sources` (name -> code) replaces files (tests)."""
    modules = _modules()
    known = set(modules)
    code = {name: path.read_text() for name, path in modules.items()}
    if sources:
        code.update(sources)
        known |= set(sources)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    return {
        name: set(_imports(ast.parse(text), name, name in packages, known))
        for name, text in code.items()
    }


def _under(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs that break the direction rules."""
    bad = set()
    for importer, imported in graph.items():
        for target in imported:
            if _under(importer, "pdplane.connector"):
                if _under(target, "pdplane") and not _under(target, CONNECTOR_MAY_IMPORT):
                    bad.add((importer, target))
                if _under(target, CONNECTOR_NEVER):
                    bad.add((importer, target))
            if _under(importer, "pdplane.gateway"):
                for part, allowed in GATEWAY_MAY_IMPORT.items():
                    if _under(target, part) and target not in allowed:
                        bad.add((importer, target))
            if (
                _under(importer, "pdplane")
                and not _under(importer, "pdplane.cli")
                and _under(target, "pdplane.cli")
            ):
                bad.add((importer, target))
            if (
                _under(importer, "tests")
                and _under(target, "bench")
                and (_under(importer, "tests.support") or _private(target))
            ):
                bad.add((importer, target))
            subject = _bench_subject(importer)
            if subject and _bench_subject(target) not in (None, subject) and _private(target):
                bad.add((importer, target))
            if (
                _under(importer, "tests")
                and _under(target, "tests")
                and not _under(target, importer)
                and (_test_module(target) or _private(target))
            ):
                bad.add((importer, target))
    return bad


def _bench_subject(name: str) -> str | None:
    """The bench subject folder of the dotted `name` (`relay` for `bench.relay.proxies`);
    None outside bench/ and for bench's top-level helpers shared by subjects (`bench._procs`)."""
    parts = name.split(".")
    if parts[0] != "bench" or len(parts) < 3 or parts[1].startswith("_"):
        return None
    return parts[1]


def _test_module(name: str) -> bool:
    """A pytest test module (`test_*.py`) anywhere in the dotted `name`
    (`tests.integration.gateway.test_cancellation`, `...test_migration._text`)."""
    return any(part.startswith("test_") for part in name.split("."))


def _private(name: str) -> bool:
    """An underscore module or name anywhere in the dotted `name` (`bench._procs`,
    `bench.routing._openloop`, `bench.vllm_cpu.ttft_breakdown._median`)."""
    return any(part.startswith("_") for part in name.split("."))


def _part(name: str) -> str:
    """What a cycle may not cross into: `pdplane.<part>`, all of `bench`, `tests.<folder>`."""
    return "bench" if _under(name, "bench") else ".".join(name.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among the modules of one part (`_part`), as strongly connected components
    of more than one module (or a module importing itself). Tarjan's algorithm."""
    edges = {
        m: sorted(t for t in targets if t in graph and t != m and _part(t) == _part(m))
        for m, targets in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_connector_and_gateway_import_only_what_they_may() -> None:
    bad = _violations(_graph())
    unexpected = sorted(bad - set(KNOWN_VIOLATIONS))
    assert unexpected == [], "against the direction rules (this module's docstring):\n" + "\n".join(
        f"  {importer} imports {imported}" for importer, imported in unexpected
    )
    stale = sorted(set(KNOWN_VIOLATIONS) - bad)
    assert stale == [], f"fixed: delete these entries of KNOWN_VIOLATIONS: {stale}"


def test_no_import_cycles_within_a_part() -> None:
    cycles = {tuple(c) for c in _cycles(_graph())}
    unexpected = sorted(cycles - set(KNOWN_CYCLES))
    assert unexpected == [], "modules importing each other: " + "; ".join(
        " <-> ".join(c) for c in unexpected
    )
    stale = sorted(set(KNOWN_CYCLES) - cycles)
    assert stale == [], f"fixed: delete these entries of KNOWN_CYCLES: {stale}"


def test_the_rules_catch_what_they_forbid() -> None:
    # Guards the guard: a wrong import in each direction (a test importing of another test
    # module, or an underscore name of a helper module, too), and a cycle, are reported.
    gw = "tests.integration.gateway"
    graph = _graph(
        {
            "pdplane.gateway.wrong": "from pdplane.scheduler.decision import Decider\n"
            "from pdplane.registry import watcher\nfrom pdplane.scheduler import Outcome\n",
            "pdplane.connector.wrong": "import pdplane.gateway.app\nfrom fastapi import FastAPI\n"
            "from ..core import layout\nfrom pdplane.registry.client import InstanceWatcher\n",
            "pdplane.plan.wrong": "from pdplane.cli import fleet_credentials\n",
            "pdplane.sim.cycle_a": "from pdplane.sim import cycle_b\n",
            "pdplane.sim.cycle_b": "def f():\n    from pdplane.sim.cycle_a import x\n",
            "tests.unit.wrong": "from bench._procs import spawn\nimport bench.routing._openloop\n"
            "from bench.vllm_cpu.ttft_breakdown import _median, breakdown\n"
            "from bench.routing import workloads\nfrom tests.support import otlp\n",
            "tests.support.wrong": "from bench.routing.workloads import Turn\n",
            f"{gw}.test_wrong": f"from {gw}.test_cancellation import _open\n"
            "from .test_tracing import receiver\n"
            "from tests.integration.registry.fixtures import _spec, make_spec\n"
            f"from {gw}.conftest import MODEL\nfrom tests.support import otlp\n",
            "bench.relay.cycle_a": "from bench.routing import cycle_b\n",
            "bench.sim.wrong": "from bench.routing._openloop import replay\n"
            "from bench.routing.workloads import Turn\nfrom bench._procs import spawn\n"
            "from bench.sim import _own\n",
            "bench.routing.cycle_b": "def f():\n    import bench.relay.cycle_a\n",
        }
    )
    found = _violations(graph) - set(KNOWN_VIOLATIONS)
    assert {v for v in found if v[0].startswith("pdplane.")} == {
        ("pdplane.gateway.wrong", "pdplane.scheduler.decision"),
        ("pdplane.gateway.wrong", "pdplane.registry"),
        ("pdplane.gateway.wrong", "pdplane.registry.watcher"),
        ("pdplane.connector.wrong", "pdplane.gateway.app"),
        ("pdplane.connector.wrong", "fastapi"),
        ("pdplane.plan.wrong", "pdplane.cli"),
        ("pdplane.plan.wrong", "pdplane.cli.fleet_credentials"),
    }
    assert {v for v in found if v[0].startswith("tests.")} == {
        ("tests.unit.wrong", "bench._procs"),
        ("tests.unit.wrong", "bench.routing._openloop"),
        ("tests.unit.wrong", "bench.vllm_cpu.ttft_breakdown._median"),
        ("tests.support.wrong", "bench.routing.workloads"),
        ("tests.integration.gateway.test_wrong", "tests.integration.gateway.test_cancellation"),
        (
            "tests.integration.gateway.test_wrong",
            "tests.integration.gateway.test_cancellation._open",
        ),
        ("tests.integration.gateway.test_wrong", "tests.integration.gateway.test_tracing"),
        ("tests.integration.gateway.test_wrong", "tests.integration.registry.fixtures._spec"),
    }
    assert {v for v in found if v[0].startswith("bench.")} == {
        ("bench.sim.wrong", "bench.routing._openloop"),
    }
    cycles = _cycles(graph)
    assert ["pdplane.sim.cycle_a", "pdplane.sim.cycle_b"] in cycles
    assert ["bench.relay.cycle_a", "bench.routing.cycle_b"] in cycles
