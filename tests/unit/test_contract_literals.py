"""No default, range or exit code of the contract is written a second time outside it.

``trainer.contract`` defines the job spec's defaults and ranges (``spec``) and the trainer's
exit codes (``exitcodes``); the gateway, the trainer's other modules, the sbatch template, and
the portal's templates and script must read them from there. This test derives the literals
from the contract objects themselves (never a hand list) and looks for them where a copy
would be one:

- Python (by AST, so an unrelated number does not count): a number equal to a field's default
  or range bound, in a context named after that field: an assignment to ``MAX_EPOCHS`` or
  ``DEFAULT_BETA`` (the name ends with the field's), a keyword or argument named ``epochs``,
  a dict entry keyed ``"epochs"``, a call given the string ``"--epochs"`` or ``"beta"``, a
  comparison with ``epochs``. An exit code (the trainer-specific ones: 0 and 1 are every
  process's) in a context named ``*exit*``, ``rc``, ``code``, ``returncode``; and in strings
  and comments, after ``exit``/``rc``/``-ne``/``-eq``.
- Templates, HTML and JS: an ``<input>`` named after a field whose ``min``/``max``/
  ``placeholder``/``value`` is one of its literals; ``'beta', 0.1`` (a default handed to
  ``.get``); a comparison with a field's name; an exit code after ``exit``/``-ne``/``-eq``/``=``.

A self-test plants a copy of each kind in a temporary tree and sees the rule fail.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer.contract import exitcodes
from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS, JOB_BOUNDS, JobSpec

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("gateway", "trainer", "slurm_templates")
SKIPPED = ("trainer/contract",)
SUFFIXES = (".py", ".html", ".js", ".sbatch", ".sh", ".j2", ".jinja")

REVIEWED: dict[tuple[str, str, float], str] = {
    # (path, field, value): why the literal is not a copy of the contract's.
    ("gateway/services/autohp.py", "epochs", 3):
        "OpenAI's cookbook TARGET_EPOCHS, the auto rule's cited figure: equal to our default by coincidence, "
        "and it must not follow the default if that changes",
}
"""Literals reviewed and kept, with the reason; a new copy must be removed or reviewed here."""

TRIVIAL = (0, 1)
"""Reviewed, for every field: 0 and 1 (0.0, 1.0) are the neutral values (no dropout, one rank, no
warm-up, seed 0, the first step) and are written everywhere with that meaning, not as a copy of
a bound; a field's other literals still catch a copied range (``IntRange(1, 100)``: the 100).
Exit codes 0 and 1 are every process's success and failure, so only codes above 1 are checked."""


@dataclass(frozen=True)
class Literal:
    """One value the contract defines: ``what`` names it (``epochs.high``, ``exit REQUEUE``)."""

    field: str
    value: float
    what: str


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def contract_literals() -> dict[str, list[Literal]]:
    """Field (or ``"exit"``) -> its literals: every numeric default and range bound of the
    hyperparameters and the spec's own fields, and every trainer-specific exit code."""
    out: dict[str, list[Literal]] = {}
    for name, default in HYPERPARAMETER_DEFAULTS.items():
        if _numeric(default):
            out.setdefault(name, []).append(Literal(name, default, f"{name} default"))
    for name, field in JobSpec.model_fields.items():
        if _numeric(field.default) and typing.get_origin(field.annotation) is not typing.Literal:  # not ``version``
            out.setdefault(name, []).append(Literal(name, field.default, f"{name} default"))
    for table in (HYPERPARAMETER_BOUNDS, JOB_BOUNDS):
        for name, bounds in table.items():
            for end, value in (("low", bounds.low), ("high", bounds.high)):
                if value is not None:
                    out.setdefault(name, []).append(Literal(name, value, f"{name} range {end}"))
    codes = {k: v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)}
    out["exit"] = [Literal("exit", v, f"exit code {k}") for k, v in codes.items() if v > 1]
    return {k: [lit for lit in v if lit.value not in TRIVIAL] for k, v in out.items()}


LITERALS = contract_literals()
FIELDS = tuple(k for k in LITERALS if k != "exit")
EXIT_WORDS = frozenset({"exit", "exits", "rc", "code", "codes", "returncode", "status"})


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    literal: Literal
    context: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.literal.value!r} ({self.literal.what}) in {self.context!r}"


def _norm(name: str) -> str:
    return name.strip().lstrip("-").lower().replace("-", "_")


def _fields_named(name: str) -> list[str]:
    """The contract fields a name refers to: the name is the field, or ends with ``_<field>``."""
    n = _norm(name)
    found = [f for f in FIELDS if n == f or n.endswith("_" + f)]
    tokens = set(n.split("_"))
    if tokens & EXIT_WORDS:
        found.append("exit")
    return found


def _constants(node: ast.AST) -> Iterator[ast.Constant]:
    """The numbers of an expression, but not subscript indexes (``bounds[1]`` is a position)."""
    indexes = {id(sub.slice) for sub in ast.walk(node) if isinstance(sub, ast.Subscript)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and _numeric(sub.value) and id(sub) not in indexes:
            yield sub


def _names(node: ast.AST) -> Iterator[str]:
    """The names an expression is about: variables, attributes, subscript keys, string constants."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and len(sub.value) <= 64:
            yield sub.value


def _target_names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        yield node.slice.value
    elif isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from _target_names(elt)


def _contexts(tree: ast.AST) -> Iterator[tuple[list[str], ast.AST]]:
    """(names, the expression whose numbers are tied to them) for every naming context."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            yield [n for t in node.targets for n in _target_names(t)], node.value
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
            yield list(_target_names(node.target)), node.value
        elif isinstance(node, ast.keyword) and node.arg:
            yield [node.arg], node.value
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            for arg, default in zip(args[len(args) - len(node.defaults):], node.defaults, strict=True):
                yield [arg.arg], default
            for arg, kwdefault in zip(node.kwonlyargs, node.kw_defaults, strict=True):
                if kwdefault is not None:
                    yield [arg.arg], kwdefault
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    yield [key.value], value
        elif isinstance(node, ast.Call):
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            numbers = [a for a in node.args if not (isinstance(a, ast.Constant) and isinstance(a.value, str))]
            if strings:
                for arg in numbers:
                    yield strings, arg
                for kw in node.keywords:
                    yield strings, kw.value
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [n for side in sides if not isinstance(side, ast.Constant) for n in _names(side)]
            for side in sides:
                if isinstance(side, ast.Constant):
                    yield names, side


_TEXT_EXIT = re.compile(r"(?:\bexit(?:s|_code)?\b|\brc\b|-ne|-eq|EXIT\w*=)[\s\"'=:(]*(\d+)\b", re.IGNORECASE)


def _text_exit_codes(text: str) -> Iterator[tuple[int, int]]:
    """(line offset, code) for every trainer exit code written after ``exit``/``rc``/``-ne``..."""
    codes = {int(lit.value) for lit in LITERALS["exit"]}
    for m in _TEXT_EXIT.finditer(text):
        if int(m.group(1)) in codes:
            yield text.count("\n", 0, m.start(1)), int(m.group(1))


def _literal(field: str, value: float) -> Literal | None:
    return next((lit for lit in LITERALS.get(field, []) if lit.value == value), None)


def scan_python(path: str, source: str) -> list[Finding]:
    """The copies in one Python file (AST contexts, then exit codes in its strings and comments)."""
    found: list[Finding] = []
    tree = ast.parse(source)
    lines = source.splitlines()
    for names, expr in _contexts(tree):
        fields = {f for n in names for f in _fields_named(n)}
        for const in _constants(expr):
            for field in sorted(fields):
                lit = _literal(field, const.value)
                if lit is not None:
                    found.append(Finding(path, const.lineno, lit, lines[const.lineno - 1].strip()))
    for node in ast.walk(tree):   # a dict keyed by exit codes, named after them: ``_EXIT_REASONS = {65: ...}``
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                and any("exit" in _fields_named(n) for t in node.targets for n in _target_names(t)):
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and _numeric(key.value) and (lit := _literal("exit", key.value)):
                    found.append(Finding(path, key.lineno, lit, lines[key.lineno - 1].strip()))
    texts: list[tuple[int, str]] = [(n.lineno, n.value) for n in ast.walk(tree)
                                    if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    texts += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type == tokenize.COMMENT]
    for lineno, text in texts:
        for offset, code in _text_exit_codes(text):
            lit = _literal("exit", code)
            assert lit is not None
            found.append(Finding(path, lineno + offset, lit, text.splitlines()[offset].strip()[:120]))
    return found


_INPUT = re.compile(r"<input\b[^>]*>", re.IGNORECASE | re.DOTALL)
_ATTR = re.compile(r"\b(name|min|max|placeholder|value)\s*=\s*\"([^\"]*)\"", re.IGNORECASE)
_GET_DEFAULT = re.compile(r"['\"](\w+)['\"]\s*,\s*(-?\d+(?:\.\d+)?(?:e-?\d+)?)\b")
_COMPARE = re.compile(r"\b(\w+)\b\s*(?:>=|<=|<|>|===?|!==?)\s*(-?\d+(?:\.\d+)?(?:e-?\d+)?)\b")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def scan_text(path: str, text: str) -> list[Finding]:
    """The copies in a template, HTML, JS or shell file."""
    found: list[Finding] = []
    lines = text.splitlines()

    def add(offset: int, field: str, raw: str) -> None:
        value = _number(raw)
        lit = _literal(field, value) if value is not None else None
        if lit is not None:
            line = text.count("\n", 0, offset)
            found.append(Finding(path, line + 1, lit, lines[line].strip()[:120]))

    for tag in _INPUT.finditer(text):
        attrs = {k.lower(): (v, tag.start() + m.start(2)) for m in _ATTR.finditer(tag.group(0))
                 for k, v in [m.groups()]}
        name = attrs.get("name", ("", 0))[0]
        for field in _fields_named(name) if name else []:
            for key in ("min", "max", "placeholder", "value"):
                if key in attrs:
                    add(attrs[key][1], field, attrs[key][0])
    for m in _GET_DEFAULT.finditer(text):
        for field in _fields_named(m.group(1)):
            add(m.start(2), field, m.group(2))
    for m in _COMPARE.finditer(text):
        for field in _fields_named(m.group(1)):
            if field != "exit":
                add(m.start(2), field, m.group(2))
    for line, code in _text_exit_codes(text):
        lit = _literal("exit", code)
        assert lit is not None
        found.append(Finding(path, line + 1, lit, lines[line].strip()[:120]))
    return found


def files(root: Path) -> Iterable[Path]:
    """The scanned files under ``root`` (the contract itself skipped)."""
    for top in SCANNED:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and path.suffix in SUFFIXES and not rel.startswith(SKIPPED) \
                    and "__pycache__" not in rel:
                yield path


def scan(root: Path) -> list[Finding]:
    """Every copy under ``root`` that is not in REVIEWED."""
    found: list[Finding] = []
    for path in files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        found += scan_python(rel, text) if path.suffix == ".py" else scan_text(rel, text)
    unique = {(f.path, f.line, f.literal): f for f in found}          # one finding per place and literal
    return [f for f in unique.values() if (f.path, f.literal.field, f.literal.value) not in REVIEWED]


def test_the_literals_come_from_the_contract_objects() -> None:
    """The list is derived, not typed: the values this test looks for are the contract's."""
    assert _literal("epochs", HYPERPARAMETER_DEFAULTS["epochs"]) is not None
    assert {lit.value for lit in LITERALS["epochs"]} == {HYPERPARAMETER_DEFAULTS["epochs"],
                                                         HYPERPARAMETER_BOUNDS["epochs"].high}   # low: 1
    assert _literal("learning_rate", HYPERPARAMETER_DEFAULTS["learning_rate"]) is not None
    assert _literal("beta", HYPERPARAMETER_DEFAULTS["beta"]) is not None
    assert {int(lit.value) for lit in LITERALS["exit"]} == {exitcodes.USER_ERROR, exitcodes.MODEL_ERROR,
                                                            exitcodes.GPU_UNAVAILABLE, exitcodes.PEER_LOST,
                                                            exitcodes.REQUEUE, exitcodes.CANCELLED}


def test_no_default_range_or_exit_code_is_written_outside_the_contract() -> None:
    found = scan(ROOT)
    assert not found, "copies of the contract's literals (read them from trainer.contract):\n" + \
        "\n".join(str(f) for f in found)


def test_every_reviewed_exception_is_still_there() -> None:
    """A reviewed exception that no longer matches anything is stale: remove it."""
    raw: list[Finding] = []
    for path in files(ROOT):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        raw += scan_python(rel, text) if path.suffix == ".py" else scan_text(rel, text)
    seen = {(f.path, f.literal.field, f.literal.value) for f in raw}
    assert not set(REVIEWED) - seen, sorted(set(REVIEWED) - seen)


PLANTED = {
    "gateway/services/copy.py": (
        "MAX_EPOCHS = 100\n"
        "DEFAULT_BETA = 0.1\n"
        "BASE_LEARNING_RATE = 2e-4\n"
        "def f(hp, epochs: int = 3):\n"
        "    return hp.get('lora_r', 16)\n"
        "LIMITS = {'max_seq_len': (8, 131_072)}\n"
        "_EXIT_REASONS = {65: 'user error'}\n"
        "def g(rc):\n"
        "    return rc == 75\n"
        "OPT = option('--epochs', type=IntRange(1, 100))\n"
        "SCRIPT = '[ \"$rc\" -ne 78 ]'\n"
        "# the trainer exits 143 on SIGTERM\n"
    ),
    "slurm_templates/copy.sbatch": "readonly REQUEUE_EXIT=75\nexit 69\n",
    "gateway/portal/templates/copy.html": (
        '<input name="epochs" type="number" min="1" max="100">\n'
        "{{ hp.get('beta', 0.1) }}\n"
    ),
    "gateway/portal/static/copy.js": "if (+epochs <= 100) refresh();\n",
}
EXPECTED = {  # (file, field or "exit", value) each planted copy must be found as
    ("gateway/services/copy.py", "epochs", 100), ("gateway/services/copy.py", "beta", 0.1),
    ("gateway/services/copy.py", "learning_rate", 2e-4), ("gateway/services/copy.py", "epochs", 3),
    ("gateway/services/copy.py", "lora_r", 16), ("gateway/services/copy.py", "max_seq_len", 8),
    ("gateway/services/copy.py", "max_seq_len", 131_072), ("gateway/services/copy.py", "exit", 65),
    ("gateway/services/copy.py", "exit", 75),
    ("gateway/services/copy.py", "exit", 78), ("gateway/services/copy.py", "exit", 143),
    ("slurm_templates/copy.sbatch", "exit", 75), ("slurm_templates/copy.sbatch", "exit", 69),
    ("gateway/portal/templates/copy.html", "epochs", 100),
    ("gateway/portal/templates/copy.html", "beta", 0.1), ("gateway/portal/static/copy.js", "epochs", 100),
}
HARMLESS = {  # numbers that equal a contract literal but are not about it: never flagged
    "gateway/services/fine.py": (
        "TIMEOUT_S = 100\n"
        "def pct(step, total):\n"
        "    return min(100, round(100 * step / total))\n"
        "LIMITS = {'page_size': (1, 100)}\n"
        "PORT = 65\n"
        "def h(n_tries: int = 3):\n"
        "    return 16 * n_tries\n"
        "learning_rate_multiplier_min = 0\n"
    ),
    "gateway/portal/templates/fine.html": '<progress max="100" value="3"></progress>\n<input name="limit" max="100">\n',
}


def _plant(tmp_path: Path, tree: dict[str, str]) -> None:
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)


def test_the_rule_fails_on_planted_copies(tmp_path: Path) -> None:
    _plant(tmp_path, PLANTED)
    found = {(f.path, f.literal.field, f.literal.value) for f in scan(tmp_path)}
    assert EXPECTED <= found, sorted(EXPECTED - found)


def test_the_rule_passes_numbers_that_are_not_about_the_contract(tmp_path: Path) -> None:
    _plant(tmp_path, HARMLESS)
    assert not scan(tmp_path), [str(f) for f in scan(tmp_path)]


@pytest.mark.parametrize("rel", sorted(PLANTED))
def test_each_planted_file_alone_fails(tmp_path: Path, rel: str) -> None:
    _plant(tmp_path, {rel: PLANTED[rel]})
    assert scan(tmp_path)
