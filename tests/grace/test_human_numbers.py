"""Numbers as a person reads them (grace/human.py): the plan's rounding (issue #41 item 4)."""

from __future__ import annotations

import pytest

from slurm_jit.grace import human


@pytest.mark.parametrize(("value", "said"), [
    (0.271128, "0.27"), (0.0000123, "0.000012"), (5.0, "5"), (3.04, "3"), (9.96, "10"), (13.5128, "13.5"),
    (48.0, "48"), (99.96, "100"), (251.25, "251"), (25339.4, "25,339"), (0.0, "0"), (-0.27, "-0.27"),
])
def test_a_number_keeps_the_digits_a_reader_uses(value: float, said: str) -> None:
    assert human.number(value) == said


@pytest.mark.parametrize(("seconds", "said"), [
    (48.0, "48 s"), (119.0, "119 s"), (180.0, "3 min"), (2670.0, "44.5 min"), (74_000.0, "20.6 h"),
    (86_400.0, "24 h"), (210_000.0, "2.4 days"),
])
def test_a_duration_is_said_in_the_unit_it_is_read_in(seconds: float, said: str) -> None:
    assert human.duration(seconds) == said


def test_a_small_chance_is_one_in_n() -> None:
    assert human.one_in(1.97e-6) == "1 in 510,000"
    assert human.one_in(0.0038) == "1 in 260"
    assert human.one_in(0.25) == "1 in 4"
    assert human.one_in(0.0) == "never"
