"""`shapeplan cache export|import|inspect`: move a warmed compile cache between machines (e.g. into an AMI)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..cache.limits import Limits
from ..warm.backends import DEVICES
from .options import limit_options


@click.group("cache")
def cache_group() -> None:
    """Export a warmed compile cache as a checked archive, and import it on another machine.

    \b
    shapeplan cache export --cache-dir /var/cache/shapeplan -o cache.tar.gz
    shapeplan cache import cache.tar.gz --cache-dir /var/cache/shapeplan
    shapeplan cache merge shard-0.tar.gz shard-1.tar.gz -o cache.tar.gz

    Exit codes: 0 done, 1 unusable (missing, damaged or tampered archive, non-empty target), 2 usage error,
    3 the archive was compiled for another environment (package versions, compiler flags, logical NeuronCore
    config): warm this machine's own cache instead.
    """


def _emit(info: Any, text: str, as_json: bool) -> None:
    click.echo(json.dumps(info.to_dict(), indent=2) if as_json else text)


def _summary(info: Any) -> str:
    compiler = info.environment.get("compiler", {})
    settings = ", ".join(f"{k}={v}" for k, v in sorted(compiler.items()) if v not in ("", None))
    return f"{info.shapes} warmed shape(s), {len(info.files)} file(s); compiled with {settings}"


@cache_group.command("export")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False, exists=True), required=True,
              metavar="DIR", help="The warmed cache dir (what `shapeplan warm --cache-dir` wrote).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, metavar="ARCHIVE",
              help="The .tar.gz to write (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print what was exported as JSON.")
def export_command(cache_dir: str, output: str, as_json: bool) -> None:
    """Write a warmed cache dir, its manifest, a sha256 per file and its environment to ARCHIVE."""
    from ..cache.archive import export_cache

    info = export_cache(Path(cache_dir), Path(output))
    _emit(info, f"exported {_summary(info)} to {info.path}", as_json)


def _limits(max_gib: float, max_files: int, max_metadata_mib: float) -> Limits:
    return Limits(max_bytes=int(max_gib * 2**30), max_files=max_files, max_metadata=int(max_metadata_mib * 2**20))


@cache_group.command("import")
@click.argument("archive", type=click.Path(dir_okay=False))
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), required=True, metavar="DIR",
              help="A new or empty folder to import into.")
@click.option("--device", type=click.Choice(DEVICES), default=None,
              help="The compiler stack to check against. Default: the archive's.")
@click.option("--json", "as_json", is_flag=True, help="Print what was imported as JSON.")
@click.option("--follow-symlink", is_flag=True, help="Import into DIR even if it is a symbolic link.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="The plan the cache is for: refuse an archive warmed for its method and model with other PEFT "
                   "(LoRA) settings only.")
@limit_options
def import_command(archive: str, cache_dir: str, device: str | None, as_json: bool, follow_symlink: bool,
                   plan_path: str | None, max_gib: float, max_files: int, max_metadata_mib: float) -> None:
    """Check ARCHIVE against this machine and extract it into DIR, all or nothing.

    Refused (nothing written) when its package versions or compiler settings differ from this machine's, or, with
    --plan, when it was warmed for the plan's method and model with other PEFT settings only (exit 3), or when a
    file is missing, added or does not match its checksum, its manifest is unusable, a member would land outside
    DIR, it exceeds the limits below, or another import is filling DIR (1).
    """
    from ..cache.archive import import_cache

    limits = _limits(max_gib, max_files, max_metadata_mib)
    run = None
    if plan_path is not None:
        from ..run import load_run

        run = load_run(plan_path, None, None, None, None, (), device or "cpu")[1].environment()
    info = import_cache(Path(archive), Path(cache_dir), device=device, limits=limits, follow_symlink=follow_symlink,
                        run=run)
    _emit(info, f"imported {_summary(info)} into {Path(cache_dir).resolve()}", as_json)


@cache_group.command("merge")
@click.argument("parts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, metavar="ARCHIVE",
              help="The merged .tar.gz to write (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print what was merged as JSON.")
@limit_options
def merge_command(parts: tuple[str, ...], output: str, as_json: bool, max_gib: float, max_files: int,
                  max_metadata_mib: float) -> None:
    """Join the archives of the shards of one plan (`warm --shard I/N`, then `cache export` each) into ARCHIVE.

    Every file of every part is checked against its checksum. Refused, nothing written: parts compiled in
    different environments (exit 3); one path with different contents in two parts, a damaged part (1).
    """
    from ..cache.archive import merge_archives

    info = merge_archives([Path(p) for p in parts], Path(output), _limits(max_gib, max_files, max_metadata_mib))
    _emit(info, f"merged {len(parts)} archive(s): {_summary(info)} into {info.path}", as_json)


@cache_group.command("inspect")
@click.argument("archive", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the archive's environment and files as JSON.")
def inspect_command(archive: str, as_json: bool) -> None:
    """Show the environment an archive was compiled in, without extracting it."""
    from ..cache.archive import read_info

    info = read_info(Path(archive))
    if as_json:
        click.echo(json.dumps({"archive": info.path, "environment": info.environment, "files": info.files},
                              indent=2))
    else:
        click.echo(f"{info.path}: {len(info.files)} file(s)")
        click.echo(json.dumps(info.environment, indent=2, sort_keys=True))
