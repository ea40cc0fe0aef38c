"""Every deliberate difference a ported test marks (``xfail(strict=True, reason="docs/X.md: <text>")``)
is stated in that doc: the quoted text is in it (line breaks and indentation aside)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
REASON = re.compile(r'"(docs/[\w./-]+\.md): ((?:[^"\\]|\\.)+)"')


def _reasons():
    found = []
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        for doc, quoted in REASON.findall(path.read_text()):
            found.append((path.name, doc, quoted.replace('\\"', '"')))
    return found


def _flat(text):
    return " ".join(text.split())


def test_the_ported_tests_state_their_differences():
    """The scan finds the marks (a scan that found none would prove nothing)."""
    docs = {doc for _, doc, _ in _reasons()}
    assert "docs/migrating.md" in docs
    assert len(_reasons()) >= 6


@pytest.mark.parametrize(("test_file", "doc", "quoted"), _reasons())
def test_xfail_reason_is_in_its_doc(test_file, doc, quoted):
    text = (ROOT / doc).read_text()
    assert _flat(quoted) in _flat(text), f"{test_file}: {doc} does not say {quoted!r}"


def test_every_strict_xfail_names_a_doc_or_a_defect():
    """An xfail here is either a difference stated in a doc or a defect, and always strict."""
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        source = path.read_text()
        for mark in re.findall(r"xfail\((.*?)reason=", source, flags=re.S):
            assert "strict=True" in mark, path.name
        for reason in re.findall(r'reason="([^"]*)"', source):
            assert reason.startswith(("docs/", "defect: ")), (path.name, reason)
