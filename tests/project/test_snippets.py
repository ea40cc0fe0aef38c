"""Every snippet of README.md and docs/ runs as written, as a new user copying it would run it.

Each page's blocks run in order in a folder of their own holding a copy of the repository's
tracked files (what a fresh clone has), so ``python examples/...`` and ``lightlike fit
examples/...`` work as written, and a block sees the files the blocks above it wrote:

- a ```python block runs as a script (in this process, for speed: a fresh ``__main__``, the
  folder as the working directory and first on ``sys.path``);
- a ```bash/```sh block runs with ``bash -e``; a ```console block runs its ``$ `` lines; a block
  of ``lightlike ...`` lines only (perhaps ``> FILE``) runs them through ``lightlike.cli.main``,
  the console script's entry point, in this process;
- a ```python, ```toml, ```yaml or ```json block whose first line is a comment naming a file
  (``# run.toml``; a JSON block cannot carry one) is that file: it is written there, not run.

A block may be preceded by a marker, an HTML comment invisible in the rendered page whose reason
stays visible in the source (keep them few):

- ``<!-- docs-test: fragment REASON -->``: not run (it needs a GPU, several processes or
  machines, the network...); REASON must say why;
- ``<!-- docs-test: covered-by tests/FILE.py::TEST -->``: run by that test (which must exist),
  where it needs what this one lacks (the network, minutes of training);
- ``<!-- docs-test: ci -->``: the CI command; it must be what ``.ci/run`` runs.

Any other marker, or a shell block marked ``run``, fails this test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- docs-test: (?P<marker>[^>]*?) -->\s*\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
SHELL = ("bash", "sh", "console")
FILES = ("python", "toml", "yaml", "json")
#: a command line of the package's own console script, its output perhaps sent to a file
LIGHTLIKE_LINE = re.compile(r"^lightlike (?P<args>[^<>|&;$`]*?)(?: > (?P<file>[\w./-]+))?\s*$")
FILE_HEADER = re.compile(r"^# ([\w./-]+\.(?:py|toml|ya?ml|json))\s*\n")


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(lang, marker, code) of the page's code blocks, in order."""
    return [(m.group("lang"), (m.group("marker") or "").strip(), m.group("code")) for m in BLOCK.finditer(page.read_text())]


def runnable(page: Path) -> bool:
    return any(lang in ("python", *SHELL) and not marker for lang, marker, _ in blocks(page))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository's tracked (and untracked, not ignored) files."""
    out = tmp_path_factory.mktemp("clone") / "lightlike"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


def check_marker(page: Path, lang: str, marker: str, code: str) -> None:
    kind, _, rest = marker.partition(" ")
    if kind == "fragment":
        assert rest.strip(), f"{page.name}: a fragment marker must say why the block is not run"
    elif kind == "covered-by":
        file, _, test = rest.partition("::")
        assert (ROOT / file).is_file() and f"def {test}(" in (ROOT / file).read_text(), f"{page.name}: no test {rest}"
    elif kind == "ci":
        assert code.strip() in (ROOT / ".ci" / "run").read_text(), f"{page.name}: {code.strip()!r} is not what .ci/run runs"
    else:
        pytest.fail(f"{page.name}: unknown marker {marker!r} on a {lang} block (fragment REASON, covered-by TEST, ci)")


def run_python(folder: Path, script: Path, monkeypatch) -> None:
    before = set(sys.modules)
    with monkeypatch.context() as mp:
        mp.chdir(folder)
        mp.syspath_prepend(str(folder))
        mp.setattr(sys, "argv", [str(script)])
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:  # modules the block imported from its folder (factory.py) are the page's own
            for name in set(sys.modules) - before:
                if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(folder)):
                    del sys.modules[name]


def run_shell(page: Path, folder: Path, lang: str, code: str, monkeypatch) -> None:
    if lang == "console":
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
    lines = [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]
    if all(LIGHTLIKE_LINE.match(line) for line in lines):
        for line in lines:
            run_lightlike(page, folder, line, monkeypatch)
        return
    env = {**os.environ, "PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["bash", "-e", "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{page.name}:\n{code}\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n{p.stderr[-3000:]}"


def run_lightlike(page: Path, folder: Path, line: str, monkeypatch) -> None:
    """``lightlike ARGS [> FILE]`` run in this process (the console script's own ``main``: the same
    command, without starting torch again for each line)."""
    from lightlike.cli import main

    m = LIGHTLIKE_LINE.match(line)
    assert m is not None
    out, err = io.StringIO(), io.StringIO()
    before = set(sys.modules)
    with monkeypatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.chdir(folder)
        mp.syspath_prepend(str(folder))
        try:
            code = main(shlex.split(m.group("args")))
        finally:
            for name in set(sys.modules) - before:
                if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(folder)):
                    del sys.modules[name]
    assert code == 0, f"{page.name}: {line}\n--- stdout\n{out.getvalue()[-2000:]}\n--- stderr\n{err.getvalue()[-3000:]}"
    if m.group("file"):
        (folder / m.group("file")).write_text(out.getvalue())


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_snippet_of_the_page_runs_as_written(page, clone, tmp_path, monkeypatch):
    folder = tmp_path / "lightlike"
    shutil.copytree(clone, folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only spins, more so on a busy machine
    try:
        run_blocks(page, folder, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def run_blocks(page: Path, folder: Path, monkeypatch) -> None:
    for i, (lang, marker, code) in enumerate(blocks(page)):
        if lang not in (*FILES, *SHELL):
            continue
        if marker:
            check_marker(page, lang, marker, code)
            continue
        header = FILE_HEADER.match(code)
        if header:
            (folder / header.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (folder / header.group(1)).write_text(code)
        elif lang == "python":
            script = folder / f"snippet_{i}.py"
            script.write_text(code)
            try:
                run_python(folder, script, monkeypatch)
            except SystemExit as e:
                assert e.code in (0, None), f"{page.name}, block {i} exited with {e.code!r}:\n{code}"
            except Exception as e:
                raise AssertionError(f"{page.name}, block {i}:\n{code}") from e
        elif lang in SHELL:
            run_shell(page, folder, lang, code, monkeypatch)


def test_the_markers_say_why():
    """Every marker on every page is one of the three, with its reason or its test."""
    for page in PAGES:
        for lang, marker, code in blocks(page):
            if marker:
                check_marker(page, lang, marker, code)
