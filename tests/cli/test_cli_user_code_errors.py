"""A user's module that fails to import or to construct under ``lightlike fit FILE:Class``: the
user's own traceback (no frame of lightlike or importlib above it) and one line naming the target
that failed; exit code 1. Run through the real command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAD = "import lightlike as ll\n"
CASES = {
    "syntax": (HEAD + "class T(ll.TaskModule):\n    def forward(self, b)\n        return b\n",
               ['  File "{file}", line 3', "SyntaxError: expected ':'"], "failed to import (SyntaxError)"),
    "import": (HEAD + "import no_such_package_for_lightlike_tests\nclass T(ll.TaskModule):\n    pass\n",
               ["Traceback (most recent call last):", '  File "{file}", line 2, in <module>',
                "ModuleNotFoundError: No module named 'no_such_package_for_lightlike_tests'"],
               "failed to import (ModuleNotFoundError)"),
    "construct": (HEAD + "def check(width):\n    raise ValueError(f'bad width {width}')\n"
                  "class T(ll.TaskModule):\n    def __init__(self, width: int = 3):\n        super().__init__()\n"
                  "        check(width)\n",
                  ["Traceback (most recent call last):", '  File "{file}", line 7, in __init__',
                   '  File "{file}", line 3, in check', "ValueError: bad width 3"],
                  "raised ValueError while it was constructed"),
}


def run_fit(tmp_path, target):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lightlike.cli", "fit", target, "--max_steps", "1", "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failing_user_module_shows_its_own_traceback_and_one_note(tmp_path, case):
    source, expected, note = CASES[case]
    file = tmp_path / "mymod.py"
    file.write_text(source)
    proc = run_fit(tmp_path, "mymod.py:T")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.rstrip("\n").splitlines()
    frames = [line for line in lines if line.startswith("  File ")]
    assert frames and all(f'"{file}"' in f for f in frames), proc.stderr  # the user's frames alone
    shown = [e.format(file=file) for e in expected]
    assert [line for line in lines if line in shown] == shown, proc.stderr  # in this order
    assert lines[-1].startswith("lightlike fit: ") and note in lines[-1], proc.stderr
    assert ("mymod.py" in lines[-1]) and sum(line.startswith("lightlike fit") for line in lines) == 1
    assert not (tmp_path / "out").exists()


def test_a_dotted_module_that_raises_on_import(tmp_path):
    (tmp_path / "pkgmod.py").write_text(HEAD + "raise RuntimeError('no GPU config found')\n")
    proc = run_fit(tmp_path, "pkgmod:T")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.rstrip("\n").splitlines()
    assert lines[:2] == ["Traceback (most recent call last):", f'  File "{tmp_path / "pkgmod.py"}", line 2, in <module>']
    assert lines[-2:] == ["RuntimeError: no GPU config found",
                          "lightlike fit: module 'pkgmod:T' failed to import (RuntimeError): its traceback is above"]
