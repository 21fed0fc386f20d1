"""Structural rules of the codebase (STYLE.md #1): who may run processes, who imports whom."""

from __future__ import annotations

import ast
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
           "gateway/local.py": "local mode: the job's trainer, inside submitit's LocalExecutor task"}


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

