"""The benchmark's output: a table of measurements, then one PASS/MISS (or INFO) line per target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Row:
    section: str
    what: str
    value: str
    note: str = ""


@dataclass
class Target:
    section: str
    what: str
    goal: str
    #: The measured value as shown ("0.93x", "3.1 ms"), or "-" when not measured.
    shown: str
    #: None when the target could not be measured (the reason is in ``shown``'s note).
    passed: bool | None
    note: str = ""
    #: Informational: measured and shown, with no goal to pass or miss.
    info: bool = False


class Report:
    def __init__(self) -> None:
        self.header: list[str] = []
        self.rows: list[Row] = []
        self.targets: list[Target] = []
        self.notes: list[str] = []

    def row(self, section: str, what: str, value: str, note: str = "") -> None:
        self.rows.append(Row(section, what, value, note))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def target(
        self,
        section: str,
        what: str,
        goal: str,
        measured: float | None,
        passed: bool | None,
        shown: str,
        note: str = "",
        *,
        info: bool = False,
    ) -> None:
        if measured is None or info:
            passed = None
        self.targets.append(Target(section, what, goal, shown, passed, note, info and measured is not None))

    def render(self) -> str:
        lines = list(self.header)
        if self.rows:
            w_what = max(len(r.what) for r in self.rows)
            w_value = max(len(r.value) for r in self.rows)
            lines.append("")
            lines.append(f"{'sec':<4}{'measurement':<{w_what}}  {'value':>{w_value}}  note")
            for r in self.rows:
                lines.append(f"{r.section:<4}{r.what:<{w_what}}  {r.value:>{w_value}}  {r.note}".rstrip())
        if self.notes:
            lines.append("")
            lines.extend(f"note: {n}" for n in self.notes)
        lines.append("")
        lines.append("targets")
        if not self.targets:
            lines.append("  (no target measured: no section ran)")
        w_what = max((len(t.what) + len(t.goal) + 1 for t in self.targets), default=0)
        for t in self.targets:
            verdict = "INFO" if t.info else "PASS" if t.passed else ("MISS" if t.passed is False else "N/A ")
            label = f"{t.what} {t.goal}"
            lines.append(f"  {verdict}  ({t.section}) {label:<{w_what}}  measured {t.shown}  {t.note}".rstrip())
        return "\n".join(lines) + "\n"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def rate(x: float) -> str:
    return f"{x:,.0f} /s"
