"""`shapeplan verify`: run every planned shape once in this fresh process and report what still compiles."""

from __future__ import annotations

import click

from .warm import device_option, emit, load_run, prepare, refused_leaves_no_cache_dir


@click.command("verify")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), required=True, metavar="PLAN",
              help="The plan to check (from `shapeplan analyze -o`).")
@device_option
def verify_command(plan_path: str, device: str | None, cache_dir: str | None, as_json: bool) -> None:
    """Check that a warmed cache covers a plan: nothing may compile.

    Runs each planned shape once, as `shapeplan warm` does, in this new process, ignoring the manifest and
    writing nothing, and reports per shape whether anything compiled (cache misses). Exit code 1 if anything
    compiled or failed.
    """
    from ..warm.runner import check_cache_dir, make_warmer, warm

    backend, cache = prepare(device, cache_dir)
    with refused_leaves_no_cache_dir(cache):
        plan, args = load_run(plan_path, "sft", None, None, None, (), backend.device)
    check_cache_dir(cache)
    warmer = make_warmer(plan.method, args)
    report = warm(plan, warmer, backend, cache, verify=True, progress=True)
    emit(report, as_json=as_json, verify=True)
