"""Structural rules of the codebase (STYLE.md #1), each with a self-test that plants a violation.

The package order (low -> high), the same table as docs/ARCHITECTURE.md. A module may import its
own package and any LOWER row; never a higher row, never another package of its own row:

  row  package(s)
    0  trainer.contract     the gateway-trainer contract: stdlib + pydantic only
    1  gateway.errors, gateway.config, gateway.state
    2  gateway.models
    3  gateway.db
    4  gateway.slurm        the scheduler adapters; the only place Slurm command lines are built
    5  gateway.storage      tenant roots, unix identities and onboarding, the broker
    6  gateway.access, gateway.datasets, accounting (the usage reports, a package of its own)
    7  gateway.services     DB writes live here and below; front ends never write the DB
    8  gateway.jobs         the reconciler loop and its rooms, submission, leader, backend
    9  gateway.api   10 gateway.portal   11 gateway.app   12 gateway.usercli
   13  gateway.devcluster   14 gateway.cli   15 gateway.__main__

Outside the table: ``trainer`` (all but ``trainer.contract``) and ``scrubber`` run on compute
nodes and import nothing of ``gateway``; the gateway may import the pure trainer modules it
uses (catalog, memory, export, quiet) inside functions, with a ``# lazy:`` comment.

The rules:
  processes        every way to start a process, only in gateway/slurm/ and reviewed modules
  Slurm binaries   sbatch, scancel, sacctmgr, ... named only in gateway/slurm/ (reviewed exceptions)
  node side        trainer/ and scrubber/ import nothing of gateway/; no shell=True anywhere
  package order    every import (module level, in functions, relative, type-only) points down
  contract         trainer/contract imports only the standard library, pydantic and itself
  top imports      project and heavy imports at module top unless ``# lazy: <why>`` says why
  CLI start        ``import gateway.cli`` loads no DB layer, app, plotting or torch (those reasons hold)
  cycles           no import cycle among project modules
  front ends       api, portal, usercli and cli write no DB row; api and portal import no gateway.slurm
  state names      job and Slurm state names spelled only in gateway/state.py
  tenant paths     tenant-layout and job-dir names joined into paths only in gateway/storage/layout.py
  error classes    the request-error families defined only in gateway/errors.py
  docstrings       every public function says what it returns or raises
  reconciler size  gateway/jobs/reconciler.py is a loop (at most 300 lines)
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["gateway", "trainer", "scrubber", "accounting"]


def _modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


@functools.cache
def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per session (the rules only read it)."""
    return ast.parse(path.read_text(), str(path))


def _package_of(path: Path, root: Path = ROOT) -> list[str]:
    """The package a relative import in ``path`` is resolved against: its folder's dotted parts
    (["gateway", "jobs"] for gateway/jobs/x.py and for gateway/jobs/__init__.py alike)."""
    if not path.is_relative_to(root):
        return []
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]


def _docstring_ids(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


# -------------------------------------------------------------------- processes
def _aliases(tree: ast.AST, module: str) -> set[str]:
    """Names ``module`` is bound to in ``tree`` (``import os``, ``import os as o``)."""
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names if a.name == module}


PROCESS_MODULES = ("subprocess", "multiprocessing", "asyncio.subprocess", "concurrent.futures.process")
OS_RUNS = re.compile(r"exec[lv]p?e?|spawn[lv]p?e?|posix_spawnp?|system|popen|fork|forkpty")
PROCESS_ATTRS = ("create_subprocess_exec", "create_subprocess_shell", "subprocess_exec",
                 "subprocess_shell", "exec_command", "ProcessPoolExecutor")


def _os_runs(name: str) -> bool:
    return OS_RUNS.fullmatch(name) is not None


def _process_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES)


def process_starts(path: Path) -> list[str]:
    """"line: how" for every way ``path`` may start a process: importing subprocess,
    multiprocessing or asyncio.subprocess (however spelled), ``os.exec*``/``spawn*``/
    ``posix_spawn*``/``system``/``popen``/``fork`` (also imported by name or through an alias,
    or fetched with ``getattr``), ``pty.spawn``/``pty.fork``, asyncio's ``create_subprocess_*``,
    paramiko's ``exec_command``, a ProcessPoolExecutor, and ``__import__``/``import_module`` of
    one of those modules."""
    tree = _parse(path)
    os_names, pty_names = _aliases(tree, "os"), _aliases(tree, "pty")
    found = []
    for node in ast.walk(tree):
        how = None
        if isinstance(node, ast.Import):
            hit = [a.name for a in node.names if _process_module(a.name)]
            how = f"imports {hit[0]}" if hit else None
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            names = [a.name for a in node.names]
            if _process_module(mod) or any(_process_module(f"{mod}.{n}") for n in names):
                how = f"imports from {mod}"
            elif mod == "os" and any(_os_runs(n) for n in names):
                how = "imports " + ", ".join(f"os.{n}" for n in names if _os_runs(n))
            elif mod == "pty" and {"spawn", "fork"} & set(names):
                how = "imports pty.spawn/fork"
            elif {"ProcessPoolExecutor"} & set(names):
                how = "imports ProcessPoolExecutor"
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in os_names and _os_runs(node.attr) or base in pty_names and node.attr in ("spawn", "fork"):
                how = f"calls {base}.{node.attr}"
            elif node.attr in PROCESS_ATTRS:
                how = f"calls .{node.attr}"
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            arg = node.args[0]
            if fn in ("__import__", "import_module") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and _process_module(arg.value):
                how = f"imports {arg.value} by name"
            elif fn == "getattr" and len(node.args) >= 2 and isinstance(arg, ast.Name) and arg.id in os_names \
                    and isinstance(node.args[1], ast.Constant) and _os_runs(name := str(node.args[1].value)):
                how = f"fetches os.{name}"
        if how:
            found.append(f"{_rel(path)}:{getattr(node, 'lineno', 0)} {how}")
    return found


# Reviewed exceptions outside gateway/slurm/: each starts a process of ours, never a Slurm job.
ALLOWED_PROCESSES = {
    "gateway/storage/launch.py": "starts the storage broker daemon (python -m gateway.storage.broker)",
    "gateway/devcluster/cluster.py": "the dev cluster: starts MariaDB and Slurm's daemons on this host",
    "gateway/storage/broker.py": "forks a child per request that drops to the tenant's uid before it opens "
                                 "anything (its one command, sbatch, runs through gateway.slurm.runner)",
    "gateway/cli/demo.py": "forks the demo's gateway server, which drops to the service user; the demo "
                           "itself stays a client",
}


def test_only_gateway_slurm_runs_processes() -> None:
    hits = {_rel(p): process_starts(p) for p in _modules()}
    bad = [v for rel, vs in hits.items() if not rel.startswith("gateway/slurm/") and rel not in ALLOWED_PROCESSES
           for v in vs]
    assert bad == [], "only gateway/slurm/ (and the reviewed ALLOWED_PROCESSES) may start processes:\n" + \
        "\n".join(bad)
    stale = [rel for rel in ALLOWED_PROCESSES if not hits.get(rel)]
    assert stale == [], f"ALLOWED_PROCESSES entries that start no process any more: {stale}"


PLANTED_PROCESSES = {
    "import subprocess": "imports subprocess",
    "import subprocess as sp": "imports subprocess",
    "from subprocess import run": "imports from subprocess",
    "from subprocess import Popen as P": "imports from subprocess",
    "import asyncio.subprocess": "imports asyncio.subprocess",
    "from asyncio import subprocess": "imports from asyncio",
    "import multiprocessing": "imports multiprocessing",
    "from multiprocessing import Process": "imports from multiprocessing",
    "import multiprocessing.pool": "imports multiprocessing.pool",
    "from concurrent.futures import ProcessPoolExecutor": "imports ProcessPoolExecutor",
    "import os\nos.system('id')": "calls os.system",
    "import os\nos.popen('id')": "calls os.popen",
    "import os\nos.execv('/bin/id', ['id'])": "calls os.execv",
    "import os\nos.execve('/bin/id', ['id'], {})": "calls os.execve",
    "import os\nos.execlp('id', 'id')": "calls os.execlp",
    "import os\nos.spawnv(os.P_WAIT, '/bin/id', ['id'])": "calls os.spawnv",
    "import os\nos.spawnlpe(os.P_WAIT, 'id', 'id', {})": "calls os.spawnlpe",
    "import os\nos.posix_spawn('/bin/id', ['id'], {})": "calls os.posix_spawn",
    "import os\nos.posix_spawnp('id', ['id'], {})": "calls os.posix_spawnp",
    "import os\nos.fork()": "calls os.fork",
    "import os as o\no.system('id')": "calls o.system",
    "from os import system\nsystem('id')": "imports os.system",
    "from os import execve as run": "imports os.execve",
    "from os import posix_spawnp": "imports os.posix_spawnp",
    "import os\ngetattr(os, 'system')('id')": "fetches os.system",
    "import pty\npty.spawn(['id'])": "calls pty.spawn",
    "from pty import spawn": "imports pty.spawn/fork",
    "import asyncio\nasyncio.create_subprocess_exec('id')": "calls .create_subprocess_exec",
    "import asyncio\nasyncio.create_subprocess_shell('id')": "calls .create_subprocess_shell",
    "async def f(loop):\n    await loop.subprocess_exec(P, 'id')": "calls .subprocess_exec",
    "def f(client):\n    client.exec_command('id')": "calls .exec_command",
    "__import__('subprocess').run(['id'])": "imports subprocess by name",
    "import importlib\nimportlib.import_module('subprocess')": "imports subprocess by name",
}


@pytest.mark.parametrize("snippet", list(PLANTED_PROCESSES))
def test_the_process_rule_catches_each_way(tmp_path: Path, snippet: str) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text(snippet + "\n")
    assert PLANTED_PROCESSES[snippet] in " | ".join(process_starts(sneaky))


def test_the_process_rule_passes_what_runs_nothing(tmp_path: Path) -> None:
    harmless = tmp_path / "x.py"
    harmless.write_text("import os\nos.environ.get('X')\nos.path.join('a', 'b')\nos.execution = 1\n"
                        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n")
    assert process_starts(harmless) == []


# --------------------------------------------------------------- Slurm binaries
SLURM_BINARIES = frozenset({
    "sbatch", "srun", "salloc", "sattach", "sbcast", "scancel", "scontrol", "squeue", "sacct",
    "sacctmgr", "sinfo", "sshare", "sprio", "sstat", "sreport", "sdiag", "strigger", "scrontab",
    "slurmctld", "slurmd", "slurmdbd", "slurmrestd", "slurmstepd"})


def slurm_binaries(path: Path) -> list[tuple[int, str]]:
    """(line, binary) of each string that names a Slurm binary as a command: a string constant
    (not a docstring) that is a Slurm binary's name or path (``"scancel"``, ``"/usr/bin/sbatch"``),
    or an f-string or string that is one followed by an option (``f"squeue -j {id}"``); prose
    that names one (``"sinfo failed: ..."``) is not a command line."""
    tree = _parse(path)
    docs = _docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value)
        else:
            continue
        words = text.split()
        if len(words) > 1 and not words[1].startswith("-"):
            continue
        word = words[0].rpartition("/")[2] if words else ""
        if word in SLURM_BINARIES and ("/" not in words[0] or words[0].startswith("/")):
            found.append((node.lineno, word))
    return sorted(set(found))


# Reviewed exceptions outside gateway/slurm/, each with its reason; pending ones shrink to none.
ALLOWED_SLURM_BINARIES = {
    "gateway/devcluster/cluster.py": "the dev cluster starts Slurm's daemons and waits for `scontrol ping`",
    "tests/slurmfake.py": "the argv-level fake plays the Slurm binaries",
    "scrubber/procs.py": "the node scrubber recognises Slurm's slurmstepd among /proc entries; runs nothing",
}


def test_slurm_binaries_are_named_only_in_gateway_slurm() -> None:
    paths = [p for p in _modules() if not _rel(p).startswith("gateway/slurm/")] + [ROOT / "tests" / "slurmfake.py"]
    hits = {_rel(p): slurm_binaries(p) for p in paths}
    bad = [f"{rel}:{line} names {word}" for rel, found in hits.items() if rel not in ALLOWED_SLURM_BINARIES
           for line, word in found]
    assert bad == [], "Slurm command lines are built only in gateway/slurm/ (the Scheduler protocol):\n" + \
        "\n".join(bad)
    stale = [rel for rel in ALLOWED_SLURM_BINARIES if not hits.get(rel)]
    assert stale == [], f"ALLOWED_SLURM_BINARIES entries that name no Slurm binary any more: {stale}"


PLANTED_SLURM = {
    'runner.run(["scancel", "--signal=TERM", job_id])': "scancel",
    'argv = ("scontrol", "hold", job_id)': "scontrol",
    'cmd = ["/usr/bin/sbatch", "--parsable"]': "sbatch",
    'ssh.exec_command(f"squeue -j {job}")': "squeue",
    'BIN = "sacctmgr"': "sacctmgr",
    'shutil.which("srun")': "srun",
    'args = ["sinfo"] + more': "sinfo",
}


@pytest.mark.parametrize("snippet", list(PLANTED_SLURM))
def test_the_slurm_binary_rule_catches_each_spelling(tmp_path: Path, snippet: str) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text('"""Calls scancel, the docstring says."""\n' + snippet + "\n")
    assert [w for _, w in slurm_binaries(sneaky)] == [PLANTED_SLURM[snippet]]


def test_the_slurm_binary_rule_passes_prose(tmp_path: Path) -> None:
    harmless = tmp_path / "x.py"
    harmless.write_text('"""sbatch and scancel."""\nmsg = "the sbatch script"\nurl = "a/sbatch/b"\n'
                        'k = "sbatch_args"\nerr = f"sinfo failed: {e}"\n')
    assert slurm_binaries(harmless) == []


# -------------------------------------------------------------------- node side
@pytest.mark.parametrize("pkg", ["trainer", "scrubber"])
def test_node_side_packages_import_nothing_from_gateway(pkg: str) -> None:
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        for node in _all_imports(_parse(path)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"{_rel(path)}:{node.lineno}" for m in mods if m == "gateway" or m.startswith("gateway.")]
    assert bad == []


def test_no_shell_true_anywhere() -> None:
    bad = [_rel(p) for p in _modules() if "shell=True" in p.read_text()]
    assert bad == []


# ---------------------------------------------------------------- package order
PACKAGE_ORDER: list[tuple[str, ...]] = [
    ("trainer.contract",),
    ("gateway.errors", "gateway.config", "gateway.state"),
    ("gateway.models",),
    ("gateway.db",),
    ("gateway.slurm",),
    ("gateway.storage",),
    ("gateway.access", "gateway.datasets", "accounting"),
    ("gateway.services",),
    ("gateway.jobs",),
    ("gateway.api",),
    ("gateway.portal",),
    ("gateway.app",),
    ("gateway.usercli",),
    ("gateway.devcluster",),
    ("gateway.cli",),
    ("gateway.__main__",),
]
RANK = {pkg: row for row, pkgs in enumerate(PACKAGE_ORDER) for pkg in pkgs}
# In no row: loaded by path, never imported (Alembic runs them from gateway.db.migrate).
UNRANKED = {"gateway.migrations": "Alembic's scripts: gateway.db.migrate loads them by path"}


def ranked_package(module: str) -> str | None:
    """The row entry ``module`` belongs to (the longest prefix in PACKAGE_ORDER), or None."""
    parts = module.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in RANK), None)


def _all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    return (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))


def _targets(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The modules an import names: ``from a import b`` names a.b (b may be a module) — a name
    inside a module still ranks as that module's package."""
    return [n for n in _imported(node, package)[::1 if isinstance(node, ast.Import) else 2]]


def order_violations(root: Path, packages: Iterable[str]) -> list[tuple[str, str, str]]:
    """(where, importer's package, imported module) for every import in ``root``'s ``packages``
    that points up the order or sideways to another package of its row: module level, inside
    functions, relative, under ``if TYPE_CHECKING:`` too (a type-only import still leans on
    the layer)."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            module = _module_name(path, root)
            src = ranked_package(module)
            if src is None:
                continue
            for node in _all_imports(_parse(path)):
                for target in _targets(node, _package_of(path, root)):
                    dst = ranked_package(target)
                    if dst is not None and dst != src and RANK[dst] >= RANK[src]:
                        found.append((f"{path.relative_to(root).as_posix()}:{node.lineno}", src, target))
    return found


def package_pairs_both_ways(root: Path, packages: Iterable[str]) -> list[tuple[str, str]]:
    """Pairs of row entries that import each other (in any direction the order allows or not)."""
    edges = set()
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            src = ranked_package(_module_name(path, root))
            for node in _all_imports(_parse(path)):
                for target in _targets(node, _package_of(path, root)):
                    dst = ranked_package(target)
                    if src and dst and src != dst:
                        edges.add((src, dst))
    return sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


ORDERED = ["gateway", "trainer", "accounting"]


def test_imports_point_down_the_package_order() -> None:
    bad = order_violations(ROOT, ORDERED)
    print(f"imports pointing back up the package order: {len(bad)}")
    assert bad == [], (f"{len(bad)} imports point up (or sideways in their row) the package order "
                       "(tests/unit/test_architecture.py PACKAGE_ORDER):\n"
                       + "\n".join(f"{w} {s} (row {RANK[s]}) imports {t}" for w, s, t in bad))
    assert len(bad) == 0


def test_no_package_pair_imports_both_ways() -> None:
    pairs = package_pairs_both_ways(ROOT, ORDERED)
    print(f"package pairs importing each other: {len(pairs)}")
    assert pairs == []


def test_every_gateway_module_has_a_row() -> None:
    lost = [_rel(p) for p in (ROOT / "gateway").rglob("*.py") if _module_name(p, ROOT) != "gateway"
            and ranked_package(_module_name(p, ROOT)) is None
            and not any(_module_name(p, ROOT).startswith(u) for u in UNRANKED)]
    assert lost == [], f"modules in no row of PACKAGE_ORDER: {lost}"
    importers = [f"{_rel(p)}:{n.lineno}" for p in _modules() for n in _all_imports(_parse(p))
                 if any(t.startswith(tuple(UNRANKED)) for t in _targets(n, _package_of(p)))]
    assert importers == [], f"UNRANKED modules are loaded by path, never imported: {importers}"


def test_the_order_rule_catches_an_upward_import(tmp_path: Path) -> None:
    gw = tmp_path / "gateway"
    for d in ("db", "access", "slurm", "services", "jobs"):
        (gw / d).mkdir(parents=True)
        (gw / d / "__init__.py").write_text("")
    (gw / "__init__.py").write_text("")
    (gw / "errors.py").write_text("import gateway.state\n")                          # same row: sideways
    (gw / "db" / "a.py").write_text("import os\n\n\ndef f():\n    from gateway.access import audit\n")
    (gw / "slurm" / "b.py").write_text("from ..storage import layout\nfrom . import c\nfrom gateway import errors\n")
    (gw / "services" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from gateway.jobs.x import Y\nfrom gateway.slurm import b\n")
    (gw / "jobs" / "e.py").write_text("import gateway.services.d\nfrom gateway import api\n")
    assert [(w, t) for w, _, t in order_violations(tmp_path, ["gateway"])] == [
        ("gateway/db/a.py:5", "gateway.access.audit"),
        ("gateway/errors.py:1", "gateway.state"),
        ("gateway/jobs/e.py:2", "gateway.api"),
        ("gateway/services/d.py:3", "gateway.jobs.x.Y"),
        ("gateway/slurm/b.py:1", "gateway.storage.layout")]
    assert package_pairs_both_ways(tmp_path, ["gateway"]) == [("gateway.jobs", "gateway.services")]


# The reasons the CLI gives for its lazy imports, checked: `finetune` (a tenant's HTTP client as
# much as the admin's tool) starts without the DB layer, the app, plotting or torch.
CLI_STARTS_WITHOUT = ("sqlalchemy", "sqlmodel", "fastapi", "matplotlib", "torch", "transformers")


def modules_loaded(statement: str, root: Path = ROOT) -> set[str]:
    """The top-level modules a fresh interpreter has loaded after running ``statement`` in ``root``."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    return set(out.stdout.split())


def test_the_cli_starts_without_the_db_layer() -> None:
    heavy = modules_loaded("import gateway.cli") & set(CLI_STARTS_WITHOUT)
    assert heavy == set(), f"`import gateway.cli` loads {sorted(heavy)}: import them in the commands that use them"


def test_the_cli_start_rule_sees_a_loaded_module(tmp_path: Path) -> None:
    (tmp_path / "sneaky.py").write_text("import sqlalchemy\n")
    assert "sqlalchemy" in modules_loaded("import sneaky", tmp_path)
    assert "sqlalchemy" not in modules_loaded("import json", tmp_path)


# ---------------------------------------------------------------------- contract
CONTRACT_MAY_IMPORT = ("pydantic", "trainer.contract")


def contract_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import in ``path`` that is neither the standard library, pydantic
    nor trainer.contract itself (relative imports resolve against ``path``'s package)."""
    found = []
    for node in _all_imports(_parse(path)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [_imported(node, _package_of(path))[1] if node.level else node.module or ""]
        found += [(node.lineno, m) for m in names if m.split(".")[0] not in sys.stdlib_module_names
                  and not any(m == a or m.startswith(a + ".") for a in CONTRACT_MAY_IMPORT)]
    return found


def test_the_contract_imports_only_stdlib_and_pydantic() -> None:
    bad = [f"{_rel(p)}:{line} imports {m}" for p in (ROOT / "trainer" / "contract").rglob("*.py")
           for line, m in contract_imports(p)]
    assert bad == [], "trainer/contract is shared by both sides: stdlib, pydantic, itself:\n" + "\n".join(bad)


def test_the_contract_rule_catches_a_foreign_import(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text("from __future__ import annotations\nimport json\nfrom pydantic import BaseModel\n"
                      "import torch\nfrom trainer import spec\nfrom trainer.contract.lines import x\n"
                      "from gateway.errors import E\nimport pydantic_settings\n\n\ndef f():\n    import yaml\n")
    assert contract_imports(sneaky) == [(4, "torch"), (5, "trainer"), (7, "gateway.errors"),
                                        (8, "pydantic_settings"), (12, "yaml")]


# ------------------------------------------------------------------ top imports
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "safetensors", "accelerate", "trl",
         "submitit", "matplotlib", "numpy", "huggingface_hub")
LAZY_TAG = "# lazy:"


def lazy_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import inside a function of a project module (gateway, trainer,
    scrubber, accounting, or relative) or a heavy third-party one (HEAVY), without a
    ``# lazy: <why>`` comment on one of its lines. ``if TYPE_CHECKING:`` blocks do not run."""
    lines = path.read_text().splitlines()
    found: list[tuple[int, str]] = []

    def visit(nodes: Iterable[ast.AST], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom) and in_function:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    ["." * node.level + (node.module or "")]
                why = "".join(line.partition(LAZY_TAG)[2].strip()
                              for line in lines[node.lineno - 1:node.end_lineno] if LAZY_TAG in line)
                found.extend((node.lineno, m) for m in names if not why and (
                    m.startswith(".") or m.split(".")[0] in (*PACKAGES, *HEAVY)))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, in_function)
            else:
                visit(ast.iter_child_nodes(node),
                      in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(_parse(path).body, False)
    return found


# Files whose owners are still changing them (issue 30, helpers H1-H3): each shrinks to none.
PENDING_LAZY: dict[str, str] = {}


def test_imports_are_at_module_top_unless_a_comment_says_why() -> None:
    hits = {_rel(p): lazy_imports(p) for p in _modules()}
    bad = [f"{rel}:{line} imports {m}" for rel, found in hits.items() if rel not in PENDING_LAZY
           for line, m in found]
    print(f"function-local project/heavy imports without a reason: {sum(map(len, hits.values()))}")
    assert bad == [], ("import at module top, or say why on the import line (`# lazy: torch`); "
                       "a cycle is no reason, break it:\n" + "\n".join(bad))
    stale = [rel for rel in PENDING_LAZY if not hits.get(rel)]
    assert stale == [], f"PENDING_LAZY entries with no function-local import left: {stale}"


def test_the_top_import_rule_catches_a_function_local_import(tmp_path: Path) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gateway.db\n\n\n"
                      "def f():\n    import json\n    from gateway.db import session_scope\n"
                      "    import torch  # lazy: torch costs 2 s at import\n"
                      "    from . import sibling\n    import transformers.models\n"
                      "    from trainer.catalog import (  # lazy:\n        model_dir)\n\n\n"
                      "class C:\n    import gateway.state\n\n    def m(self):\n"
                      "        from accounting import usage\n        from trainer.catalog import (\n"
                      "            model_dir,  # lazy: the trainer side, for this command only\n        )\n")
    assert lazy_imports(sneaky) == [(9, "gateway.db"), (11, "."), (12, "transformers.models"),
                                    (13, "trainer.catalog"), (21, "accounting")]


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
        for node in _runtime_imports(_parse(path)):
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
SLURM_FREE = ("gateway/api", "gateway/portal")
FRONT_ENDS = ("gateway/api", "gateway/portal", "gateway/usercli", "gateway/cli")
SESSION_WRITES = {"add", "add_all", "delete", "merge", "commit", "flush", "bulk_save_objects",
                  "bulk_insert_mappings", "bulk_update_mappings"}
ROW_WRITES = {"add", "add_all", "delete", "merge"}
SQL_WRITES = {"insert", "update", "delete"}
SESSION_MAKERS = {"Session", "session_scope", "sessionmaker", "get_session"}
SESSION_READS = {"exec", "execute", "get", "query", "scalars", "scalar"}


def _front_end_modules(dirs: tuple[str, ...]) -> list[Path]:
    return [p for d in dirs for p in (ROOT / d).rglob("*.py")]


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(enclosing top-level function or class name, or "<module>"; node) for every node."""
    for top in tree.body:
        name = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
            else "<module>"
        for node in ast.walk(top):
            yield name, node


def slurm_imports(path: Path) -> list[tuple[str, str]]:
    """(where, what) for each import of gateway.slurm in ``path``: function-local ones too."""
    package = _package_of(path)
    found = []
    for fn, node in _functions(_parse(path)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [m for m in _imported(node, package) if m == "gateway.slurm" or m.startswith("gateway.slurm.")]
            if mods:
                found.append((f"{_rel(path)}:{fn}", f"line {node.lineno} imports {min(mods, key=len)}"))
    return found


def _table_models(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to gateway.models' classes, names bound to the module gateway.models itself)."""
    classes, modules = set(), set()
    for node in _all_imports(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gateway.models":
            classes |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "gateway" and \
                any(a.name == "models" for a in node.names):
            modules |= {a.asname or a.name for a in node.names if a.name == "models"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or "gateway.models" for a in node.names if a.name == "gateway.models"}
    return classes, modules


def _call_name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else \
        call.func.attr if isinstance(call.func, ast.Attribute) else ""


class _Writes:
    """What one front-end module's code writes: session and row kinds are told by what they
    are (a ``Session`` annotation, a session made or entered, a table model of gateway.models
    built, fetched or selected), never by what they are called."""

    def __init__(self, tree: ast.Module):
        self.classes, self.modules = _table_models(tree)
        self.sessions: set[str] = set()
        self.rows: set[str] = set()

    def is_model(self, node: ast.AST) -> bool:
        """A table model class: ``Job``, ``models.Job``, ``gateway.models.Job``."""
        if isinstance(node, ast.Name):
            return node.id in self.classes
        return isinstance(node, ast.Attribute) and ast.unparse(node.value) in self.modules

    def mentions_model(self, node: ast.AST) -> bool:
        return any(self.is_model(n) for n in ast.walk(node))

    def is_row(self, node: ast.AST) -> bool:
        """An expression that is (or holds) a table-model row: ``Job(...)``, a row name, a list of them."""
        if isinstance(node, ast.Call):
            return self.is_model(node.func)
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return any(self.is_row(e) for e in node.elts)
        if isinstance(node, ast.ListComp | ast.GeneratorExp):
            return self.is_row(node.elt)
        return isinstance(node, ast.Name) and node.id in self.rows

    def learn(self, scope: ast.AST) -> None:
        """Collect the session and row names bound in ``scope`` (a function or the module)."""
        for node in ast.walk(scope):
            if isinstance(node, ast.arg) and node.annotation is not None and "Session" in ast.unparse(node.annotation):
                self.sessions.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and "Session" in ast.unparse(node.annotation):
                self.sessions.add(node.target.id)
            elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name) \
                    and isinstance(node.context_expr, ast.Call) and _call_name(node.context_expr) in SESSION_MAKERS:
                self.sessions.add(node.optional_vars.id)
            elif isinstance(node, ast.Assign | ast.For | ast.comprehension):
                value = node.iter if isinstance(node, ast.For | ast.comprehension) else node.value
                targets = [node.target] if isinstance(node, ast.For | ast.comprehension) else node.targets
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                if isinstance(value, ast.Call) and _call_name(value) in SESSION_MAKERS:
                    self.sessions.update(names)
                elif self.is_row(value) or self.mentions_model(value) and any(
                        isinstance(c, ast.Call) and _call_name(c) in SESSION_READS | {"select"}
                        for c in ast.walk(value)):
                    self.rows.update(names)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in SESSION_READS and node.args and self.mentions_model(node.args[0]) \
                    and isinstance(node.func.value, ast.Name):
                self.sessions.add(node.func.value.id)      # x.get(Job, 1), x.exec(select(Job)): x is a session

    def is_session(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.sessions or \
            isinstance(node, ast.Call) and _call_name(node) in SESSION_MAKERS

    def write(self, call: ast.Call) -> bool:
        """Whether ``call`` writes the database."""
        if not isinstance(call.func, ast.Attribute):
            return False
        verb, receiver = call.func.attr, call.func.value
        if verb in SESSION_WRITES and self.is_session(receiver):
            return True
        if verb in ROW_WRITES and call.args and self.is_row(call.args[0]):
            return True
        return verb in ("execute", "exec") and any(
            isinstance(n, ast.Call) and _call_name(n) in SQL_WRITES and (
                self.mentions_model(n) or isinstance(n.func, ast.Attribute) and "__table__" in ast.unparse(n.func))
            for a in call.args for n in ast.walk(a))


def session_writes(path: Path) -> list[tuple[str, str]]:
    """(where, what) for each database write in ``path``: ``add/add_all/delete/merge`` of a
    table-model row on any receiver, ``add/.../commit/flush`` on a session (however named), an
    ``insert/update/delete`` of a table model executed on any receiver, and a row's optimistic
    ``version`` set by hand (only the services' update function bumps it)."""
    tree = _parse(path)
    found: list[tuple[int, str, str]] = []
    module = _Writes(tree)
    module.learn(ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                                                | ast.ClassDef)], type_ignores=[]))
    for top in tree.body:
        name = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else "<module>"
        scope = _Writes(tree)
        scope.sessions, scope.rows = set(module.sessions), set(module.rows)
        scope.learn(top)
        for node in ast.walk(top):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [(node.lineno, f"{_rel(path)}:{name}", f"line {node.lineno} sets {ast.unparse(t)}")
                          for t in targets if isinstance(t, ast.Attribute) and t.attr == "version"]
            if isinstance(node, ast.Call) and scope.write(node):
                found.append((node.lineno, f"{_rel(path)}:{name}",
                              f"line {node.lineno} calls {ast.unparse(node.func)}"))
    return [(where, what) for _, where, what in sorted(found)]


# Known and left for now (files outside the change that added these tests): "path:function".
ALLOWED_SLURM_IMPORTS: dict[str, str] = {}
ALLOWED_SESSION_WRITES: dict[str, str] = {}


Finder = Callable[[Path], list[tuple[str, str]]]


def _check_front_ends(dirs: tuple[str, ...], find: Finder, allowed: dict[str, str]) -> tuple[list[str], list[str]]:
    hits = [h for p in _front_end_modules(dirs) for h in find(p)]
    bad = [f"{where}: {what}" for where, what in hits if where not in allowed]
    stale = sorted(set(allowed) - {where for where, _ in hits})
    return bad, stale


def test_front_ends_do_not_import_the_slurm_adapter() -> None:
    bad, stale = _check_front_ends(SLURM_FREE, slurm_imports, ALLOWED_SLURM_IMPORTS)
    assert bad == [], "gateway/api and gateway/portal reach Slurm through gateway/services:\n" + "\n".join(bad)
    assert stale == [], f"ALLOWED_SLURM_IMPORTS entries no longer needed: {stale}"


def test_front_ends_do_not_write_to_the_database() -> None:
    bad, stale = _check_front_ends(FRONT_ENDS, session_writes, ALLOWED_SESSION_WRITES)
    assert bad == [], "front ends write through gateway/services functions (STYLE.md #9):\n" + "\n".join(bad)
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
    sneaky.write_text(
        "import sqlalchemy as sa\nfrom sqlmodel import Session, select, update\nfrom gateway import models\n"
        "from gateway.db import session_scope\nfrom gateway.models import Job as J\n\n\n"
        "def route(q: Session, f, job, seen: set, engine):\n"       # 8: q is a session by its annotation
        "    q.add(job)\n    q.flush()\n    job.version += 1\n"      # 9-11
        "    q.execute(sa.delete(J).where(J.id == 1))\n    q.commit()\n"   # 12-13
        "    q.exec(select(J))\n    f.flush()\n    q.get(J, 1)\n    seen.add(job)\n"   # 14-17: reads, a set
        "    with session_scope(engine) as conn:\n        conn.merge(job)\n"   # 18-19
        "    zz = Session(engine)\n    zz.commit()\n"                  # 20-21
        "    anything.add(J(name='x'))\n    anything.add_all([models.Tenant(name='t')])\n"   # 22-23
        "    row = db.get(J, 1)\n    other.delete(row)\n"            # 24-25: db is a session by what it reads
        "    x.exec(update(models.Job).values(status='done'))\n    db.flush()\n")   # 26-27
    assert [what for _, what in session_writes(sneaky)] == [
        "line 9 calls q.add", "line 10 calls q.flush", "line 11 sets job.version",
        "line 12 calls q.execute", "line 13 calls q.commit", "line 19 calls conn.merge",
        "line 21 calls zz.commit", "line 22 calls anything.add", "line 23 calls anything.add_all",
        "line 25 calls other.delete", "line 26 calls x.exec", "line 27 calls db.flush"]


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
    tree = _parse(path)
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
def _jobdir_names() -> set[str]:
    """The job directory's names, from the contract that defines them (trainer.contract.jobdir)."""
    from trainer.contract import jobdir

    return {v for k, v in vars(jobdir).items() if k.isupper() and isinstance(v, str)}


JOBDIR_NAMES = _jobdir_names()
JOBDIR_FILES = {n for n in JOBDIR_NAMES if "." in n or n.isupper()}    # not the folders, which are JSON keys too
LAYOUT_NAMES = {"tenants", "datasets", "jobs", "artifacts"} | JOBDIR_NAMES
URL_PREFIXES = ("/v1/", "/portal/")
PATH_CALLS = {"join", "joinpath", "Path", "PurePath", "PosixPath", "PurePosixPath", "with_name"}


def _layout_segment(text: object, *, alone: bool) -> str | None:
    """The layout name ``text`` spells as a path segment: the whole string (``alone``: it is
    one component, as in ``x / "jobs"``) or between slashes (``"tenants/a"``, ``"/jobs/"``)."""
    if not isinstance(text, str):
        return None
    if alone and text in LAYOUT_NAMES:
        return text
    segments = text.split("/")
    return next((s for s in segments if s in LAYOUT_NAMES), None) if len(segments) > 1 else None


def path_spellings(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each tenant-layout name used to build a path: ``x / "jobs"``, a parts
    tuple ``("jobs", ...)``, ``os.path.join(x, "jobs")``, ``p.joinpath("jobs")``, ``Path(x,
    "jobs")``, ``"/".join([x, "jobs"])``, an f-string ``f"{root}/tenants/{t}"``, a
    concatenation ``root + "/jobs/" + j`` and a %-format ``"%s/jobs/%s" % ...``.
    and a job-directory name (trainer.contract.jobdir) handed to any call, ``open_file(d,
    "COMPLETE")``. URL paths (f-strings and strings that start with ``/v1/`` or ``/portal/``)
    are not file paths."""
    tree = _parse(path)
    type_args = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}   # Literal["jobs", ...]
    found: list[tuple[int, int, str]] = []

    def note(node: ast.AST, alone: bool) -> None:
        if isinstance(node, ast.Constant):
            texts = [node.value]
        elif isinstance(node, ast.JoinedStr):
            texts = [v.value for v in node.values if isinstance(v, ast.Constant)]
            if texts and str(texts[0]).startswith(URL_PREFIXES):
                return
            alone = False
        else:
            return
        for text in texts:
            if isinstance(text, str) and text.startswith(URL_PREFIXES):
                continue
            name = _layout_segment(text, alone=alone)
            if name:
                found.append((node.lineno, node.col_offset, name))

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                note(side, alone=True)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
            for side in (node.left, node.right) if isinstance(node.op, ast.Add) else (node.left,):
                note(side, alone=False)
        elif isinstance(node, ast.Tuple) and id(node) not in type_args:
            for e in node.elts:
                note(e, alone=True)
        elif isinstance(node, ast.Call) and _call_name(node) in PATH_CALLS:
            slash_join = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Constant) \
                and node.func.value.value == "/"
            args = [e for a in node.args for e in (a.elts if slash_join and isinstance(a, ast.List | ast.Tuple)
                                                   else [a])]
            if _call_name(node) != "join" or slash_join or ast.unparse(node.func).endswith("path.join"):
                for a in args:
                    note(a, alone=True)
        elif isinstance(node, ast.JoinedStr):
            note(node, alone=False)
        if isinstance(node, ast.Call):
            found += [(a.lineno, a.col_offset, a.value) for a in node.args
                      if isinstance(a, ast.Constant) and a.value in JOBDIR_FILES]
    return [(line, name) for line, _, name in sorted(set(found))]


# Outside the layout module but reviewed: "path" -> why (the broker's verbs open the layout's
# parts beneath the tenant root; they name no component themselves unless listed here).
ALLOWED_PATHS: dict[str, str] = {}


def test_tenant_paths_are_spelled_only_in_the_layout_module() -> None:
    hits = {_rel(p): path_spellings(p) for p in _modules() if _rel(p).startswith(("gateway/", "accounting/"))
            and _rel(p) != "gateway/storage/layout.py" and not _rel(p).startswith("gateway/migrations/")}
    bad = [f"{rel}:{line} builds a path with {name!r}: use gateway.storage.layout"
           for rel, found in hits.items() if rel not in ALLOWED_PATHS for line, name in found]
    assert bad == [], "tenant storage paths outside gateway/storage/layout.py:\n" + "\n".join(bad)
    stale = [rel for rel in ALLOWED_PATHS if not hits.get(rel)]
    assert stale == [], f"ALLOWED_PATHS entries that spell no layout name any more: {stale}"


PLANTED_PATHS = {
    'p = root / "tenants" / t': "tenants",
    'q = (*job, "checkpoints")': "checkpoints",
    'p = root / "jobs/abc"': "jobs",
    'p = f"{root}/tenants/{t}"': "tenants",
    'p = f"{root}/{t}/jobs"': "jobs",
    'p = os.path.join(root, "artifacts", a)': "artifacts",
    'p = path.join(root, "datasets")': "datasets",
    'p = root.joinpath("staging")': "staging",
    'p = Path(root, t, "events.jsonl")': "events.jsonl",
    'p = pathlib.PurePosixPath("/srv", "attempts")': "attempts",
    'p = "/".join([root, "spec.json"])': "spec.json",
    'p = root + "/jobs/" + j': "jobs",
    'p = str(root) + "/tenants"': "tenants",
    'p = "%s/artifacts/%s" % (root, a)': "artifacts",
    'fd = safefs.open_file(d, "COMPLETE", max_size=4096)': "COMPLETE",
    'raw = read(job_file(j, "events.jsonl"))': "events.jsonl",
    'names = ADAPTER + ("eval.json",)': "eval.json",
}


@pytest.mark.parametrize("snippet", list(PLANTED_PATHS))
def test_the_path_rule_catches_each_form(tmp_path: Path, snippet: str) -> None:
    sneaky = tmp_path / "x.py"
    sneaky.write_text(snippet + "\n")
    assert [n for _, n in path_spellings(sneaky)] == [PLANTED_PATHS[snippet]]


def test_the_path_rule_passes_words_and_urls(tmp_path: Path) -> None:
    harmless = tmp_path / "x.py"
    harmless.write_text('label = "jobs"\nc = built.get("checkpoints")\nmsg = f"{n} jobs running"\n'
                        'url = f"/v1/fine_tuning/jobs/{j}"\n'
                        'u2 = f"/portal/jobs/{j}"\n'
                        'x: Literal["jobs", "files"]\nk = ", ".join(["jobs", "datasets"])\n'
                        'u = "/v1/files/" + f\ns = "3 jobs" + tail\n')
    assert path_spellings(harmless) == []


# ----------------------------------------------------------------- error classes

ERROR_BASES = {"ServiceError", "SlurmError"}


def error_definitions(path: Path) -> list[tuple[int, str]]:
    """Classes in ``path`` that define a cross-layer error family or extend ServiceError's."""
    service_family = _service_family()
    found = []
    for node in ast.walk(_parse(path)):
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

    visit(_parse(path).body, "")
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


# ------------------------------------------------------------- reconciler size
RECONCILER_MAX_LINES = 300


def over_size(path: Path, limit: int) -> int | None:
    """The line count of ``path`` when it is over ``limit``; None when within."""
    lines = len(path.read_text().splitlines())
    return lines if lines > limit else None


def test_the_reconciler_is_a_loop() -> None:
    lines = len((ROOT / "gateway" / "jobs" / "reconciler.py").read_text().splitlines())
    print(f"gateway/jobs/reconciler.py: {lines} lines")
    assert over_size(ROOT / "gateway" / "jobs" / "reconciler.py", RECONCILER_MAX_LINES) is None, (
        f"gateway/jobs/reconciler.py is {lines} lines: the loop calls rooms of their own (recovery, "
        f"sweeps, expected starts, cancel/pause workers, cleanup) and stays within {RECONCILER_MAX_LINES}")


def test_the_size_rule_counts_lines(tmp_path: Path) -> None:
    long = tmp_path / "r.py"
    long.write_text("x = 1\n" * (RECONCILER_MAX_LINES + 1))
    assert over_size(long, RECONCILER_MAX_LINES) == RECONCILER_MAX_LINES + 1
    long.write_text("x = 1\n" * RECONCILER_MAX_LINES)
    assert over_size(long, RECONCILER_MAX_LINES) is None
