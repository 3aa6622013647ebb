"""`shapeplan verify`: run every planned shape once in this fresh process and report what still compiles."""

from __future__ import annotations

import click

from .options import device_option, quiet_option
from .output import ProgressBar, emit_warm, quiet, quiet_libraries


@click.command("verify")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), required=True, metavar="PLAN",
              help="The plan to check (from `shapeplan analyze -o`).")
@device_option
@quiet_option
def verify_command(plan_path: str, device: str | None, cache_dir: str | None, as_json: bool) -> None:
    """Check that a warmed cache covers a plan: nothing may compile.

    Runs each planned shape once, as `shapeplan warm` does, in this new process, ignoring the manifest, and reports
    per shape whether anything compiled (cache misses). The cache dir is only read (it may be read-only): the run
    compiles into a private scratch view of it, deleted afterwards. Exit code 1 if anything compiled or failed; 3
    if the cache's manifest holds only shapes warmed in another environment (versions, compiler settings,
    TorchNeuron's execution mode NEURON_LAUNCH_BLOCKING).
    """
    from ..cache.contents import refuse_incomplete_import
    from ..services.run import choose_backend, load_run
    from ..warm.cachedir import existing_cache_dir, scratch_view
    from ..warm.manifest import refuse_other_environment
    from ..warm.runner import warm

    backend, path = choose_backend(device, cache_dir)
    cache = existing_cache_dir(path)
    refuse_incomplete_import(cache)
    with scratch_view(cache) as scratch:
        backend.prepare(scratch / "cache", scratch=scratch)
        refuse_other_environment(cache, backend.device)
        quiet_libraries()
        plan, warmer = load_run(plan_path, None, None, None, None, (), backend.device)
        progress = ProgressBar("verifying", quiet=quiet())
        report = warm(plan, warmer, backend, cache, verify=True, progress=progress)
    emit_warm(report, as_json=as_json, verify=True, rows_shown=progress.rows > 0)
