"""The Python versions pyproject promises (``requires-python``), checked on the source.

Two checks, so a newer-only name fails here before a user on the oldest version meets it:

1. every module parses with the grammar of the oldest promised version (``ast.parse(feature_version=...)``),
   and imports no name from the standard library that only a newer version has (a list kept here);
2. where an interpreter of that oldest version is installed (``python3.10`` on PATH or under pyenv), it
   compiles every module and looks up every standard-library module and name the source uses, so the list
   in 1. is not the only guard. The package itself cannot be imported there without a torch build for it.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "ulysses_sp").rglob("*.py"))
MIN_PYTHON = tuple(int(x) for x in re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)"',
                                             (ROOT / "pyproject.toml").read_text()).groups())
# standard-library names newer than 3.10 (what a 3.10 interpreter lacks), by the version that added them
NEWER = {
    (3, 11): {"typing": {"Required", "NotRequired", "Self", "LiteralString", "Never", "assert_never",
                         "assert_type", "reveal_type", "TypeVarTuple", "Unpack", "dataclass_transform",
                         "get_overloads", "clear_overloads"},
              "enum": {"StrEnum", "ReprEnum", "verify", "member", "nonmember", "global_enum"},
              "datetime": {"UTC"}, "contextlib": {"chdir"}, "hashlib": {"file_digest"}, "operator": {"call"},
              "asyncio": {"TaskGroup", "timeout", "Runner"}, "tomllib": {"*"}, "wsgiref.types": {"*"}},
    (3, 12): {"typing": {"override", "TypeAliasType"}, "itertools": {"batched"}},
    (3, 13): {"typing": {"ReadOnly", "TypeIs", "get_protocol_members", "is_protocol", "NoDefault"},
              "warnings": {"deprecated"}, "copy": {"replace"}},
}


def _stdlib_uses(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``from M import name`` and every ``M.name`` after ``import M``
    (``(M, "*")`` for the import itself), standard-library modules only (as this interpreter lists them)."""
    tree = ast.parse(path.read_text())
    uses: set[tuple[str, str]] = set()
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            uses |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                uses.add((alias.name, "*"))
                if alias.asname:  # ``import a.b as x``: x is a.b
                    bound[alias.asname] = alias.name
                else:  # ``import a.b``: binds a
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            uses.add((bound[node.value.id], node.attr))
    return {(m, n) for m, n in uses if m.split(".")[0] in sys.stdlib_module_names and m != "__future__"}


def _too_new(path: Path, oldest: tuple[int, int]) -> list[str]:
    newer = [(v, names) for v, names in NEWER.items() if v > oldest]
    return [f"{path.name}: {m}.{n} needs Python >= {v[0]}.{v[1]}" for m, n in sorted(_stdlib_uses(path))
            for v, names in newer if n in names.get(m, ()) or "*" in names.get(m, ())]


def test_sources_parse_with_the_oldest_promised_grammar():
    """Bug caught: syntax of a newer Python (``except*``, ``type X = ...``, ``class C[T]``) in a module,
    which the oldest version pyproject promises cannot even parse."""
    wrong = []
    for path in SOURCES:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=MIN_PYTHON)
        except SyntaxError as err:
            wrong.append(f"{path.relative_to(ROOT)}:{err.lineno} {err.msg}")
    assert not wrong, f"not Python {MIN_PYTHON} syntax:\n" + "\n".join(wrong)


def test_no_standard_library_name_newer_than_promised():
    """Bug caught: ``from typing import Required`` (Python 3.11) in data/sharding.py, which broke
    ``import ulysses_sp`` on the 3.10 that pyproject promises."""
    wrong = [w for path in SOURCES for w in _too_new(path, MIN_PYTHON)]
    assert not wrong, "use an older spelling or raise requires-python (and the README):\n" + "\n".join(wrong)


def test_the_newer_name_check_can_fail(tmp_path):
    """Bug caught: a version check that flags nothing (what it must flag, and what it must not)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import datetime as dt\nimport enum\nfrom typing import Any, Required\nimport tomllib\n"
                      "x = dt.UTC, dt.timezone, enum.Enum\n")
    found = sorted(w.split(": ", 1)[1] for w in _too_new(sample, (3, 10)))
    assert found == ["datetime.UTC needs Python >= 3.11", "tomllib.* needs Python >= 3.11",
                     "typing.Required needs Python >= 3.11"]
    assert _too_new(sample, (3, 11)) == []


def test_readme_states_the_promised_version():
    """Bug caught: the README promising another Python than pyproject's ``requires-python``."""
    assert f"Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}" in (ROOT / "README.md").read_text()


def _oldest_interpreter() -> str | None:
    name = f"python{MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(f"{pyenv}/versions/{MIN_PYTHON[0]}.{MIN_PYTHON[1]}.*/bin/python")) + [shutil.which(name)]
    for python in filter(None, found):  # a pyenv shim of a version not selected exits non-zero
        if subprocess.run([python, "-c", ""], capture_output=True, timeout=60).returncode == 0:
            return python
    return None


_PROBE = """
import importlib, importlib.util, json, sys
paths, uses = json.loads(sys.stdin.read())
wrong = []
for path in paths:
    try:
        compile(open(path).read(), path, "exec")
    except SyntaxError as err:
        wrong.append(f"{path}:{err.lineno}: {err.msg}")
for module, name in uses:
    try:
        found = importlib.import_module(module)
    except ImportError:
        wrong.append(f"no module {module}")
        continue
    if name == "*" or hasattr(found, name):
        continue
    try:  # a submodule (``import os.path``) is not an attribute until imported
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        wrong.append(f"{module}.{name} missing")
print(json.dumps([sys.version.split()[0], wrong]))
"""


def test_the_oldest_promised_interpreter_compiles_and_finds_every_stdlib_name():
    """Bug caught: a name or syntax the oldest promised Python lacks that the list above does not know of
    (the real interpreter compiles each module and looks up each standard-library name the source uses)."""
    python = _oldest_interpreter()
    if python is None:
        pytest.skip(f"no Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} installed (python3.x on PATH or under pyenv)")
    uses = sorted({u for path in SOURCES for u in _stdlib_uses(path)})
    out = subprocess.run([python, "-c", _PROBE], input=json.dumps([[str(p) for p in SOURCES], uses]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version, wrong = json.loads(out.stdout)
    assert version.startswith(f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}.")
    assert not wrong, f"Python {version} cannot use:\n" + "\n".join(wrong)
