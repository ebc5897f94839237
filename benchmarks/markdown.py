"""Markdown tables for benchmark output (pasted as is into docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Sequence


def print_header(headers: Sequence[str]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))


def print_row(cells: Sequence[str]) -> None:
    print("| " + " | ".join(cells) + " |")
