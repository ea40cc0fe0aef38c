"""The docs site builds with mkdocs --strict; the API reference covers every public name; the
configuration reference is generated from ``FitConfig``; every test a page cites exists. (That
every snippet runs as written: tests/project/test_snippets.py.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_docs_site_builds(tmp_path):
    """``mkdocs build --strict``: every page in the nav, no broken links, the API reference
    generated from docstrings (mkdocstrings)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs/mkdocstrings not installed (pip install -e '.[docs]')")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "init_module" in api and "save_checkpoint_state" in api  # docstrings made it in
    assert "mkdocs-material-" in (tmp_path / "site" / "index.html").read_text()  # the theme mkdocs.yml names


#: The packages whose ``__all__`` is public API, and ``lightlike.errors`` (every exception class).
PUBLIC = ("lightlike", "lightlike.callbacks", "lightlike.loggers", "lightlike.data", "lightlike.strategies",
          "lightlike.precision", "lightlike.checkpoint", "lightlike.interop", "lightlike.search")


def public_names() -> dict[str, object]:
    import importlib

    import lightlike.errors

    names = {}
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            names[f"{package}.{name}"] = getattr(module, name)
    for name, obj in vars(lightlike.errors).items():
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == "lightlike.errors":
            names[f"lightlike.errors.{name}"] = obj
    return names


def test_the_api_reference_covers_every_public_name():
    """Each class and function of ``public_names()`` has a ``::: path`` entry in docs/api.md that
    imports as that very object; each constant (a tuple, a pattern, a file name) is named in the
    page's text."""
    import importlib

    text = (ROOT / "docs" / "api.md").read_text()
    documented = []
    for path in re.findall(r"^::: ([\w.]+)\s*$", text, re.M):
        module, _, name = path.rpartition(".")
        try:
            documented.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # a module documented whole
            documented.append(importlib.import_module(path))
    missing = []
    for full, obj in public_names().items():
        if callable(obj):
            if not any(obj is d for d in documented):
                missing.append(full)
        elif f"`{full}`" not in text and f"`{full.rsplit('.', 1)[1]}`" not in text:
            missing.append(full)
    assert not missing, f"docs/api.md has no entry for {missing}"


def config_table() -> str:
    """The configuration reference, generated from ``FitConfig`` (names, defaults, help)."""
    import dataclasses

    from lightlike.config import FitConfig

    rows = ["| field | default | what |", "|---|---|---|"]
    for f in dataclasses.fields(FitConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append(f"| `{f.name}` | `{default!r}` | {f.metadata.get('help', '').replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def test_config_reference_is_generated_from_the_dataclass():
    """docs/config.md holds the table generated from FitConfig, so the page cannot drift from the
    code (regenerate: LIGHTLIKE_REGEN_DOCS=1 pytest tests/project/test_docs.py -k config_reference)."""
    page = ROOT / "docs" / "config.md"
    head = ("# Configuration reference\n\nEvery `Fitter` keyword is a field of `ll.FitConfig`; the same names are "
            "the command line's flags and the config files' keys. Generated from the dataclass by "
            "`tests/project/test_docs.py`.\n\n")
    if os.environ.get("LIGHTLIKE_REGEN_DOCS"):
        page.write_text(head + config_table())
    assert page.read_text() == head + config_table()


def test_every_test_a_page_cites_exists():
    """`tests/<file>.py` and `tests/<file>.py::<test>` (a parametrized id or a `*` prefix
    allowed) named in the docs point at a file and a test function that exist."""
    missing = []
    for page in PAGES:
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::([\w*]+))?", page.read_text()):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{page.name}: {path}")
            elif name and not re.search(rf"^def {name.replace('*', '[A-Za-z0-9_]*')}\(", source.read_text(), re.M):
                missing.append(f"{page.name}: {path}::{name}")
    assert not missing, missing


def test_the_migration_page_names_every_other_frameworks_name():
    """Every HF Trainer / Lightning name the config's error hints know (``config.OTHER_NAMES``) is
    in docs/migrating.md's tables, inside backticks, so the page and the hints agree."""
    from lightlike.config import OTHER_NAMES

    text = (ROOT / "docs" / "migrating.md").read_text()
    quoted = " ".join(re.findall(r"`([^`\n]+)`", text))
    missing = [name for name in OTHER_NAMES if not re.search(rf"\b{name}\b", quoted)]
    assert not missing, f"docs/migrating.md does not name {missing}"
