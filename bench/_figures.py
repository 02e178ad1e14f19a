"""The record every benchmark returns, and the machine it ran on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure beside its same-run reference.

    ``ratio`` is value / reference unless the benchmark says otherwise in
    ``ratio_note``; ``goal`` is the text of the goal (e.g. "<= 1.3").
    """

    area: str
    name: str
    value: float
    unit: str
    reference_name: str
    reference_value: float
    ratio: float
    goal: str
    met: bool
    notes: str = ""
