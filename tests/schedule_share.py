"""How much of each generated schedule ran on the compiled path, for the property tests.

A schedule in which every call ran the stock step proves nothing about the compiled path (the
stock step is trivially bit-exact against itself), so ``add`` fails on one. Each schedule's share
goes to hypothesis (``event`` for ``--hypothesis-show-statistics``, ``note`` for a failing
example), and ``summary`` gives one line for the whole test.
"""
from __future__ import annotations

from typing import List, Tuple

from hypothesis import event, note

__all__ = ["CompiledShare"]


class CompiledShare:
    def __init__(self, name: str):
        self.name = name
        self.rows: List[Tuple[int, int]] = []

    def add(self, compiled: int, calls: int) -> None:
        note(f"{compiled} of {calls} calls ran a compiled class")
        assert compiled >= 1, f"vacuous schedule: none of its {calls} calls ran a compiled class"
        self.rows.append((compiled, calls))
        share = compiled / calls
        event("compiled share: " + ("all calls" if share == 1 else "at least half" if share >= 0.5
                                    else "under half"))

    def summary(self) -> str:
        if not self.rows:
            return f"{self.name}: no schedules ran"
        compiled, calls = (sum(col) for col in zip(*self.rows))
        return (f"{self.name}: {len(self.rows)} schedules, {compiled} of {calls} calls compiled "
                f"({compiled / calls:.0%}), fewest in one schedule {min(c for c, _ in self.rows)}")
