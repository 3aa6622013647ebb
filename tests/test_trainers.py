"""The trainer registry: every spec names TRL's real script, trainer and config, and what the CLI offers is it."""

from __future__ import annotations

import importlib
from typing import get_args

import click

from shapeplan.cli import cli
from shapeplan.plan.model import Method, Phase
from shapeplan.services.trainers import TRAINERS


def test_every_method_has_one_spec_naming_trl_s_own_classes() -> None:
    assert tuple(TRAINERS) == get_args(Method)
    for name, spec in TRAINERS.items():
        assert spec.name == name
        parser = importlib.import_module(spec.script).make_parser()
        # the script parses into the spec's config class: `trl <name>` trains with that config
        assert spec.config() in parser.dataclass_types, name
        assert spec.trainer().__name__ == spec.trainer_class
        assert set(spec.phases) <= set(get_args(Phase)) and "train" in spec.phases
        assert callable(spec.plan_function()) and callable(spec.warmer_class().run)


def test_the_cli_offers_the_registered_methods() -> None:
    analyze = cli.commands["analyze"]
    method = next(p for p in analyze.params if p.name == "method")
    assert isinstance(method.type, click.Choice) and tuple(method.type.choices) == tuple(TRAINERS)
