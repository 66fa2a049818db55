"""make flaky-check's comparison: a test whose outcome differs between runs is named with every run's outcome."""

from __future__ import annotations

from scripts.flaky_check import changed


def test_only_tests_whose_outcome_changed_are_reported() -> None:
    runs = [
        {"a": "passed", "b": "passed", "c": "failed"},
        {"a": "passed", "b": "failed", "c": "failed"},
        {"a": "passed", "b": "passed"},
    ]
    assert changed(runs) == {"b": ["passed", "failed", "passed"], "c": ["failed", "failed", "absent"]}
    assert changed([{"a": "passed"}] * 3) == {}
