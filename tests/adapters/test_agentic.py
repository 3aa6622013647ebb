"""What the warm-up's trainer takes in place of a run's tools and environments: the standalone tools and one probed
instance's methods per environment (never its `reset`), and one reward column per environment class that owns a
reward."""

from __future__ import annotations

import pytest

from shapeplan.adapters.agentic import Agentic, probed_tools
from shapeplan.errors import UsageError
from tests.oracle import agentic_tools


class _Scored(agentic_tools.Calculator):
    def reset(self, **row: object) -> str:
        raise AssertionError("the warm-up has no rows to reset with")

    def get_reward(self) -> float:
        return 1.0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a * b


def test_probed_tools_are_the_tools_and_each_environments_methods() -> None:
    assert probed_tools(Agentic()) == ([], 0)
    tools, rewarded = probed_tools(Agentic(tools=(agentic_tools.now,), environment_factory={
        "plain": agentic_tools.Calculator, "scored": _Scored, "again": _Scored}))
    assert [tool.__name__ for tool in tools] == ["now", "add", "multiply"] and rewarded == 1
    with pytest.raises(UsageError, match="the environment 'broken' has no reset method"):
        probed_tools(Agentic(environment_factory={"broken": object}))
