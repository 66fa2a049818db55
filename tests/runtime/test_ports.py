"""Free ports: side-by-side test runners each pick from their own slice of the range, children included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.runtime import ports
from kvmesh.runtime.ports import PORT_RANGE_ENV, free_port, port_range, port_slice


def test_slices_are_disjoint_and_inside_the_range() -> None:
    slices = [tuple(map(int, port_slice(i, 3).split("-"))) for i in range(3)]
    assert slices[0][0] == ports._LOW and slices[-1][1] <= ports._HIGH
    for (_, high), (low, _) in zip(slices, slices[1:]):
        assert high < low


def test_a_process_and_its_children_pick_inside_their_slice(monkeypatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20049")
    assert port_range() == (20000, 20049)
    assert all(20000 <= free_port() <= 20049 for _ in range(20))
    child = subprocess.run(
        [sys.executable, "-c", "from kvmesh.runtime.ports import free_port; print(free_port())"],
        env=os.environ.copy(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert 20000 <= int(child.stdout) <= 20049


@pytest.mark.parametrize("value", ["20000", "20000-19000", "80-90", "20000-99999", "a-b"])
def test_a_range_that_is_not_a_slice_of_the_range_is_refused_by_name(monkeypatch, value) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()
