"""What a user installs: the wheel built from this tree (its version, license, type marker and
dependency markers), the TOML reading of Python 3.10 (no ``tomllib``: its backport ``tomli``),
and the ``tox -e oldest`` pins equal to the floors pyproject.toml declares."""

from __future__ import annotations

import ast
import email
import importlib.metadata
import importlib.resources
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightlike
from lightlike.utils import toml

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = toml.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel setuptools builds from a copy of the tree whose ``lightlike/__init__.py`` says
    ``__version__ = "9.8.7.dev1"``: (its METADATA, its file names, the zip)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lightlike", src / "lightlike", ignore=shutil.ignore_patterns("__pycache__"))
    init = src / "lightlike" / "__init__.py"
    text, n = re.subn(r'^__version__ = "[^"]*"$', '__version__ = "9.8.7.dev1"', init.read_text(), flags=re.M)
    assert n == 1, "lightlike/__init__.py has no __version__ line"
    init.write_text(text)
    p = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b; print(b.build_wheel('dist'))"],
                       cwd=src, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    z = zipfile.ZipFile(src / "dist" / p.stdout.strip().splitlines()[-1])
    names = z.namelist()
    meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    return meta, names, z


def test_the_version_has_one_place(wheel):
    """The wheel's version is lightlike/__init__.py's ``__version__`` (pyproject reads it), and
    the installed metadata agrees with the package."""
    meta, _, _ = wheel
    assert meta["Version"] == "9.8.7.dev1"
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert lightlike.__version__ == importlib.metadata.version("lightlike")


def test_the_wheel_ships_the_license_and_the_type_marker(wheel):
    meta, names, z = wheel
    assert meta["License-Expression"] == "Apache-2.0" == PYPROJECT["project"]["license"]
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    text = z.read(license_file).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text  # the full text, all nine sections
    assert "9. Accepting Warranty or Additional Liability" in text and "END OF TERMS AND CONDITIONS" in text
    assert "lightlike/py.typed" in names
    assert importlib.resources.files("lightlike").joinpath("py.typed").is_file()
    assert "Typing :: Typed" in meta.get_all("Classifier")


def test_python_3_10_gets_tomli(wheel):
    """requires-python says 3.10; tomllib is 3.11+, so 3.10 installs its backport."""
    meta, _, _ = wheel
    assert meta["Requires-Python"] == ">=3.10"
    assert 'tomli>=1.1; python_version < "3.11"' in meta.get_all("Requires-Dist")


def test_toml_is_read_where_tomllib_is_missing(tmp_path):
    """As on Python 3.10 (``import tomllib`` raises ModuleNotFoundError there): lightlike's TOML
    reader (loaded alone, without torch) reads through tomli, and it is the only place in the
    package that imports a TOML parser (config files, ``FitConfig.from_toml``, FSDP option files)."""
    script = f"""
import importlib.util, sys
sys.modules["tomllib"] = None  # what Python 3.10 has: no such module
spec = importlib.util.spec_from_file_location("toml_reader", {str(ROOT / "lightlike" / "utils" / "toml.py")!r})
reader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reader)
assert reader.loads.__module__.startswith("tomli"), reader.loads.__module__
assert reader.loads('max_steps = 7\\n[model]\\nwidth = 3') == {{"max_steps": 7, "model": {{"width": 3}}}}
try:
    reader.loads("x = ")
    raise SystemExit("no TOMLDecodeError for 'x = '")
except reader.TOMLDecodeError:
    pass
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    importers = []
    for source in sorted((ROOT / "lightlike").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            if any(n and n.split(".")[0] in ("tomllib", "tomli") for n in names):
                importers.append(str(source.relative_to(ROOT)))
    assert importers == ["lightlike/utils/toml.py", "lightlike/utils/toml.py"], importers


def floor(requirement: str) -> str:
    m = re.fullmatch(r"([\w.-]+)>=([\w.]+)(;.*)?", requirement.strip())
    assert m, requirement
    return m.group(2)


def test_tox_oldest_pins_the_declared_floors():
    """``tox -e oldest`` installs exactly the lowest torch and tomli pyproject.toml allows, on the
    lowest Python it allows."""
    deps = {floor_req.split(">=")[0]: floor(floor_req) for floor_req in PYPROJECT["project"]["dependencies"]
            if ">=" in floor_req}
    tox = (ROOT / "tox.ini").read_text().split("[testenv:oldest]", 1)[1].split("\n[", 1)[0]
    pins = dict(re.findall(r"^\s*(?:deps =)?\s*([\w-]+)==([\w.]+)\s*$", tox, re.M))
    assert pins["torch"].removesuffix(".0") == deps["torch"]
    assert pins["tomli"].removesuffix(".0") == deps["tomli"]
    assert f"basepython = python{PYPROJECT['project']['requires-python'].removeprefix('>=')}" in tox
    for test_file in re.findall(r"(tests/\S+\.py)", tox):
        assert (ROOT / test_file).is_file(), test_file
