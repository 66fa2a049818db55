"""Printing benchmark tables: one plain-text format for every bench/ script."""

from __future__ import annotations


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = "+".join("-" * (w + 2) for w in widths)
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*headers))
    print(line)
    for row in rows:
        print(fmt.format(*[str(x) for x in row]))
