"""Structural rules of the codebase (STYLE.md #1): who may run processes, who imports whom."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["gateway", "trainer", "scrubber", "accounting"]
PROCESS_CALLS = {("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execvp"),
                 ("os", "spawnv"), ("os", "posix_spawn"), ("pty", "spawn")}


def _modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        if any(n == "subprocess" or n.startswith("subprocess.") or n == "asyncio.subprocess"
               for n in names):
            found.append(f"{rel}:{node.lineno} imports subprocess")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in PROCESS_CALLS:
                found.append(f"{rel}:{node.lineno} calls "
                             f"{node.value.id}.{node.attr}")
            if node.attr in ("exec_command", "create_subprocess_exec",
                             "create_subprocess_shell"):
                found.append(f"{rel}:{node.lineno} calls .{node.attr}")
    return found


# Reviewed exceptions: each starts our own code, never a Slurm binary.
ALLOWED = {"gateway/storage/launch.py": "starts the storage broker daemon (python -m gateway.storage.broker)",
           "gateway/slurm/local.py": "local mode: the job's trainer, inside submitit's LocalExecutor task",
           "gateway/devcluster/cluster.py": "the dev cluster: starts MariaDB and Slurm's daemons on this host"}


def test_only_gateway_slurm_runs_processes() -> None:
    bad = [v for p in _modules() if "gateway/slurm" not in p.as_posix()
           and p.relative_to(ROOT).as_posix() not in ALLOWED for v in _violations(p)]
    assert bad == [], "only gateway/slurm/ may run commands:\n" + "\n".join(bad)


def test_the_rule_itself_catches_a_subprocess_call(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text("import os\nfrom subprocess import run\nos.system('id')\n")
    assert len(_violations(sneaky)) == 2


@pytest.mark.parametrize("pkg", ["trainer", "scrubber"])
def test_node_side_packages_import_nothing_from_gateway(pkg: str) -> None:
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for m in mods
                    if m == "gateway" or m.startswith("gateway.")]
    assert bad == []


def test_no_shell_true_anywhere() -> None:
    bad = [f"{p.relative_to(ROOT)}" for p in _modules() if "shell=True" in p.read_text()]
    assert bad == []


# ------------------------------------------------------------------ import graph
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run: module level and inside functions, not ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: Iterable[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            else:
                visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The absolute names an import may load: ``import a.b`` → a.b; ``from a import b`` → a.b
    and a (b may be a module or a name in a); relative ones resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [n for a in node.names for n in (f"{base}.{a.name}", base)]


def import_graph(root: Path, packages: list[str]) -> dict[str, dict[str, str]]:
    """Project module → {project module it imports: "path:line" of the first such import}."""
    paths = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, dict[str, str]] = {m: {} for m in paths}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            names = _imported(node, package)
            if isinstance(node, ast.ImportFrom):      # a.b when it is a module, else a
                names = [m if m in paths else base for m, base in zip(names[::2], names[1::2], strict=True)]
            for target in names:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def import_cycles(graph: dict[str, dict[str, str]],
                  ignored: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """One cycle per strongly connected component of ``graph`` without the ``ignored`` edges,
    each as ["a (a.py:3)", "b (b.py:7)", "a"]: who imports whom, and where."""
    skip = set(ignored)
    edges = {m: sorted(t for t in ts if (m, t) not in skip) for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:      # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            components.append([v, *comp])

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in sorted(sorted(c) for c in components if len(c) > 1):
        cycle = _shortest_cycle(comp[0], set(comp), edges)
        cycles.append([f"{a} ({graph[a][b]})" for a, b in pairwise(cycle)] + [cycle[0]])
    return cycles


def _shortest_cycle(start: str, members: set[str], edges: dict[str, list[str]]) -> list[str]:
    """[start, ..., start]: the shortest way back to ``start`` inside its component (breadth first)."""
    parent: dict[str, str] = {}
    queue = [start]
    for v in queue:
        for w in edges[v]:
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle")


# Cycles that are known and left for now, each broken here at the edge that should go
# (in files outside the change that added this test). Any other cycle fails the test.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def test_no_import_cycles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    cycles = import_cycles(graph, ignored=ALLOWED_CYCLE_EDGES)
    assert cycles == [], "import cycles among project modules:\n" + "\n".join(" -> ".join(c) for c in cycles)
    stale = [f"{a} -> {b}" for a, b in ALLOWED_CYCLE_EDGES if b not in graph.get(a, {})]
    assert stale == [], "ALLOWED_CYCLE_EDGES names imports that are gone; remove them:\n" + "\n".join(stale)


def test_the_rule_itself_catches_an_import_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")                     # function-local
    (pkg / "c.py").write_text("import os\n\n\ndef g():\n    import pkg.a.x\n")      # a name inside pkg.a
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert import_cycles(graph) == [["pkg.a (pkg/a.py:1)", "pkg.b (pkg/b.py:2)", "pkg.c (pkg/c.py:5)", "pkg.a"]]
    assert import_cycles(graph, ignored=[("pkg.c", "pkg.a")]) == []
    assert "pkg.a" not in graph["pkg.d"]                                    # type-only: not a cycle


# ------------------------------------------------------------------- front ends
FRONT_ENDS = ("gateway/api", "gateway/portal")
SESSION_WRITES = {"add", "add_all", "delete", "commit", "flush", "merge"}
SQL_WRITES = {"insert", "update", "delete"}


def _front_end_modules() -> list[Path]:
    return [p for d in FRONT_ENDS for p in (ROOT / d).rglob("*.py")]


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(enclosing top-level function or class name, or "<module>"; node) for every node."""
    for top in tree.body:
        name = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
            else "<module>"
        for node in ast.walk(top):
            yield name, node


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def slurm_imports(path: Path) -> list[tuple[str, str]]:
    """(where, what) for each import of gateway.slurm in ``path``: function-local ones too."""
    package = list(path.relative_to(ROOT).parts[:-1]) if path.is_relative_to(ROOT) else []
    found = []
    for fn, node in _functions(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [m for m in _imported(node, package) if m == "gateway.slurm" or m.startswith("gateway.slurm.")]
            if mods:
                found.append((f"{_rel(path)}:{fn}", f"line {node.lineno} imports {min(mods, key=len)}"))
    return found


def _is_session(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("s", "db", "sess") or name.endswith("session")


def session_writes(path: Path) -> list[tuple[str, str]]:
    """(where, what) for each write through a DB session in ``path``: ``session.add/delete/
    commit/flush/merge(...)``, ``session.execute/exec(<an insert, update or delete>)``, and a
    row's optimistic ``version`` set by hand (only ``services.jobs.update_fields`` bumps it)."""
    found: list[tuple[int, str, str]] = []
    for fn, node in _functions(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(node.lineno, f"{_rel(path)}:{fn}", f"line {node.lineno} sets {ast.unparse(t)}")
                      for t in targets if isinstance(t, ast.Attribute) and t.attr == "version"]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and _is_session(node.func.value)):
            continue
        verb = node.func.attr
        sql = verb in ("execute", "exec") and any(
            isinstance(n, ast.Call) and (n.func.attr if isinstance(n.func, ast.Attribute)
                                         else getattr(n.func, "id", "")) in SQL_WRITES
            for a in node.args for n in ast.walk(a))
        if verb in SESSION_WRITES or sql:
            found.append((node.lineno, f"{_rel(path)}:{fn}", f"line {node.lineno} calls {ast.unparse(node.func)}"))
    return [(where, what) for _, where, what in sorted(found)]


# Known and left for now (files outside the change that added these tests): "path:function".
ALLOWED_SLURM_IMPORTS: dict[str, str] = {}
ALLOWED_SESSION_WRITES: dict[str, str] = {}


Finder = Callable[[Path], list[tuple[str, str]]]


def _check_front_ends(find: Finder, allowed: dict[str, str]) -> tuple[list[str], list[str]]:
    hits = [h for p in _front_end_modules() for h in find(p)]
    bad = [f"{where}: {what}" for where, what in hits if where not in allowed]
    stale = sorted(set(allowed) - {where for where, _ in hits})
    return bad, stale


def test_front_ends_do_not_import_the_slurm_adapter() -> None:
    bad, stale = _check_front_ends(slurm_imports, ALLOWED_SLURM_IMPORTS)
    assert bad == [], "gateway/api and gateway/portal reach Slurm through gateway/services:\n" + "\n".join(bad)
    assert stale == [], f"ALLOWED_SLURM_IMPORTS entries no longer needed: {stale}"


def test_front_ends_do_not_write_to_the_database() -> None:
    bad, stale = _check_front_ends(session_writes, ALLOWED_SESSION_WRITES)
    assert bad == [], "routes write through gateway/services functions (STYLE.md #9):\n" + "\n".join(bad)
    assert stale == [], f"ALLOWED_SESSION_WRITES entries no longer needed: {stale}"


def test_the_rule_itself_catches_a_slurm_import(tmp_path: Path) -> None:
    sneaky = tmp_path / "route.py"
    sneaky.write_text("import gateway.slurm\nfrom gateway.services import cluster\n\n\n"
                      "def page():\n    from gateway.slurm.runner import SlurmError\n\n\n"
                      "class Page:\n    from gateway import slurm\n")
    assert slurm_imports(sneaky) == [("route.py:<module>", "line 1 imports gateway.slurm"),
                                     ("route.py:page", "line 6 imports gateway.slurm.runner"),
                                     ("route.py:Page", "line 10 imports gateway.slurm")]


def test_the_rule_itself_catches_a_session_write(tmp_path: Path) -> None:
    sneaky = tmp_path / "route.py"
    sneaky.write_text("import sqlalchemy as sa\n\n\ndef route(session, f, job):\n"
                      "    session.add(job)\n    session.flush()\n    job.version += 1\n"
                      "    session.execute(sa.delete(Job).where(Job.id == 1))\n    session.commit()\n"
                      "    session.exec(sa.select(Job))\n    f.flush()\n    session.get(Job, 1)\n")
    assert [what for _, what in session_writes(sneaky)] == [
        "line 5 calls session.add", "line 6 calls session.flush", "line 7 sets job.version",
        "line 8 calls session.execute", "line 9 calls session.commit"]


# ----------------------------------------------------------------- state names
def _state_words() -> set[str]:
    from gateway.state import JobState, SlurmState

    return {s.value for s in JobState} | {s.value for s in SlurmState}


# The same word in another vocabulary, or a module that plays Slurm: "path:word" -> why.
ALLOWED_STATE_WORDS = {
    "gateway/services/progress.py:failed": "a trainer event type (events.jsonl), not a job state",
    "gateway/storage/__init__.py:failed": "the fallback text of a broker error",
    "gateway/slurm/local.py:RUNNING": "submitit's own LocalJob.state word, not Slurm's",
}
PLAYS_SLURM = {"gateway/state.py", "tests/slurmfake.py"}   # the vocabulary itself; the argv fake


def state_word_literals(path: Path, words: set[str]) -> list[tuple[str, int, str]]:
    """(word, line, kind) of every string constant in ``path`` that is a job or Slurm state name."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.value, n.lineno, "literal") for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in words
            and id(n) not in docstrings]


def test_state_names_are_spelled_only_in_jobs_state() -> None:
    words = _state_words()
    bad, used = [], set()
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel in PLAYS_SLURM or rel.startswith("gateway/migrations/") or rel.startswith(("trainer/", "scrubber/")):
            continue
        for word, line, _ in state_word_literals(path, words):
            key = f"{rel}:{word}"
            if key in ALLOWED_STATE_WORDS:
                used.add(key)
            else:
                bad.append(f"{rel}:{line} spells {word!r}: use gateway.state (JobState / SlurmState)")
    assert bad == [], "state names outside gateway/state.py:\n" + "\n".join(bad)
    assert used == set(ALLOWED_STATE_WORDS), f"stale ALLOWED_STATE_WORDS: {set(ALLOWED_STATE_WORDS) - used}"


def test_the_state_name_rule_catches_a_literal(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text('"""Docstring mentions running."""\nif job.status == "running" or st == "PENDING":\n    pass\n')
    assert [w for w, _, _ in state_word_literals(sneaky, _state_words())] == ["running", "PENDING"]


# ----------------------------------------------------------------- tenant paths
LAYOUT_NAMES = {"tenants", "datasets", "jobs", "artifacts", "attempts", "checkpoints", "staging",
                "events.jsonl", "spec.json"}


def path_spellings(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each tenant-layout name used to build a path: ``x / "jobs"`` or a
    parts tuple ``("jobs", ...)``."""
    tree = ast.parse(path.read_text(), str(path))
    type_args = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}   # Literal["jobs", ...]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.left, node.right]
        elif isinstance(node, ast.Tuple) and id(node) not in type_args:
            parts = list(node.elts)
        else:
            continue
        found += [(p.lineno, p.col_offset, p.value) for p in parts
                  if isinstance(p, ast.Constant) and isinstance(p.value, str) and p.value in LAYOUT_NAMES]
    return [(line, name) for line, _, name in sorted(found)]


def test_tenant_paths_are_spelled_only_in_the_layout_module() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} builds a path with {name!r}: use gateway.storage.layout"
           for p in _modules() if p.relative_to(ROOT).parts[0] in ("gateway", "accounting")
           and not p.relative_to(ROOT).as_posix().startswith(("gateway/storage/", "gateway/migrations/"))
           for line, name in path_spellings(p)]
    assert bad == [], "tenant storage paths outside gateway/storage/layout.py:\n" + "\n".join(bad)


def test_the_path_rule_catches_a_spelled_path(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text('p = root / "tenants" / t\nq = (*job, "checkpoints")\nlabel = "jobs"\n')
    assert [n for _, n in path_spellings(sneaky)] == ["tenants", "checkpoints"]


# ----------------------------------------------------------------- error classes

ERROR_BASES = {"ServiceError", "SlurmError"}


def error_definitions(path: Path) -> list[tuple[int, str]]:
    """Classes in ``path`` that define a cross-layer error family or extend ServiceError's."""
    service_family = _service_family()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases}
            if node.name in ERROR_BASES or bases & service_family:
                found.append((node.lineno, node.name))
    return found


def _service_family() -> set[str]:
    tree = ast.parse((ROOT / "gateway" / "errors.py").read_text())
    family = {"ServiceError"}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and {getattr(b, "id", "") for b in node.bases} & family:
            family.add(node.name)
    return family


def test_request_errors_are_defined_only_in_gateway_errors() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} defines {name}: put it in gateway/errors.py"
           for p in _modules() if p.relative_to(ROOT).as_posix() != "gateway/errors.py"
           for line, name in error_definitions(p)]
    assert bad == [], "error classes outside gateway/errors.py:\n" + "\n".join(bad)


def test_the_error_rule_catches_a_local_service_error(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text("from gateway.errors import NotFound\nclass Gone(NotFound):\n    status = 410\n"
                      "class SlurmError(Exception):\n    pass\nclass Fine(ValueError):\n    pass\n")
    assert [n for _, n in error_definitions(sneaky)] == ["Gone", "SlurmError"]


# ------------------------------------------------------------------- docstrings
DOCUMENTED = ("gateway", "trainer", "scrubber", "accounting")


def _accessor_or_overload(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``@overload`` stubs and ``@x.setter``/``@x.deleter``: the getter or the implementation
    carries the docstring (Python shows the getter's for a property)."""
    for d in fn.decorator_list:
        name = d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""
        if name == "overload" or (isinstance(d, ast.Attribute) and name in ("setter", "deleter")):
            return True
    return False


def undocumented(path: Path) -> list[tuple[int, str]]:
    """(line, qualified name) of each public function or method in ``path`` without a docstring.

    Public: its name and its classes' names do not start with ``_``. Functions nested in
    functions are not looked at; module- and class-level ``if``/``try`` blocks are."""
    found: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if not node.name.startswith("_") and not ast.get_docstring(node) \
                        and not _accessor_or_overload(node):
                    found.append((node.lineno, prefix + node.name))
            elif isinstance(node, ast.ClassDef):
                if not node.name.startswith("_"):
                    visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *(h.body for h in getattr(node, "handlers", []))):
                    visit(block, prefix)

    visit(ast.parse(path.read_text(), str(path)).body, "")
    return found


def test_public_functions_have_docstrings() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for pkg in DOCUMENTED for p in sorted((ROOT / pkg).rglob("*.py"))
           if not p.relative_to(ROOT).as_posix().startswith("gateway/migrations/versions/")
           for line, name in undocumented(p)]
    assert bad == [], ("public functions without a docstring (one true line: what it returns or raises, "
                       "or the non-obvious thing):\n" + "\n".join(bad))


def test_the_docstring_rule_catches_an_undocumented_function(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text('def bare():\n    def inner():\n        pass\n\n\n'
                      'def told():\n    """Said."""\n\n\n'
                      'async def _private():\n    pass\n\n\n'
                      'class Box:\n    def open(self):\n        return 1\n\n'
                      '    @property\n    def size(self):\n        """Its size."""\n\n'
                      '    @size.setter\n    def size(self, v):\n        pass\n\n'
                      '    class Lid:\n        async def lift(self):\n            ...\n\n\n'
                      'class _Hidden:\n    def run(self):\n        pass\n\n\n'
                      'if True:\n    def maybe():\n        pass\n')
    assert undocumented(sneaky) == [(1, "bare"), (15, "Box.open"), (27, "Box.Lid.lift"), (37, "maybe")]
