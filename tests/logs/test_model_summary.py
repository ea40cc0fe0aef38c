"""BF mutation round: model_summary's table format and the lazy-parameter note."""
from __future__ import annotations

import torch
from torch import nn

from lightlike.loggers.summary import model_summary


def test_summary_rows_use_thousands_separators_and_columns_line_up():
    # nn.Linear(1024, 1000): 1,024,000 weights + 1,000 biases = 1,025,000 (known by hand)
    net = nn.Sequential(nn.Linear(1024, 1000), nn.ReLU(), nn.Linear(1000, 1))
    lines = model_summary(net).splitlines()
    header, rule, row0, row1, row2 = lines[:5]
    assert header.split() == ["name", "type", "params", "trainable"]
    assert row0.split() == ["0", "Linear", "1,025,000", "1,025,000"]
    assert row2.split() == ["2", "Linear", "1,001", "1,001"]
    # a fixed-width table: every row as wide as the header, the numbers right-aligned under
    # the ends of 'params' and 'trainable', and the rule as long as the header
    assert len(rule) == len(header) and set(rule) == {"-"}
    for row in (row0, row1, row2):
        assert len(row) == len(header), (row, header)
    p_end = header.index("params") + len("params")
    assert row0[:p_end].endswith("1,025,000") and row1[:p_end].endswith(" 0")
    assert row0.endswith("1,025,000") and header.endswith("trainable")


def test_summary_short_numbers_still_fill_the_trainable_column():
    # all counts short: the column must still be as wide as the word 'trainable' (9)
    lines = model_summary(nn.Sequential(nn.Linear(2, 2))).splitlines()
    header, row = lines[0], lines[2]
    assert row.split() == ["0", "Linear", "6", "6"]
    assert len(row) == len(header)
    assert header.index("trainable") == len(header) - 9
    assert row[header.index("params"):header.index("params") + 6] == "     6"


def test_summary_notes_uninitialised_lazy_parameters_wherever_they_are():
    note = "(uninitialized lazy parameters counted as 0 until the first forward)"
    # the lazy layer first, an initialised one after it (its parameters come last)
    net = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2))
    text = model_summary(net)
    assert text.splitlines()[-1] == note
    assert "total params: 8  trainable: 8" in text  # 3*2 + 2, the lazy one counted as 0
    net(torch.zeros(1, 5))  # materialised: 5*3 + 3 = 18 more, and no note
    text = model_summary(net)
    assert note not in text and "total params: 26  trainable: 26" in text
