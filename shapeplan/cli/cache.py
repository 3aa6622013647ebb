"""`shapeplan cache export|import|merge|inspect`: move a warmed compile cache between machines (e.g. into an AMI) as
an archive; `cache push|pull`: through a shared store (S3 or any fsspec URL); `cache ls|prune`: what a cache dir or
a store holds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ..cache.limits import Limits
from ..errors import UsageError
from ..warm.backends import DEVICES
from .options import limit_options


@click.group("cache")
def cache_group() -> None:
    """Move, share and tidy warmed compile caches: archives (export, import, merge, inspect), stores (push, pull)
    and cache dirs (ls, prune).

    \b
    shapeplan cache export --cache-dir /var/cache/shapeplan -o cache.tar.gz
    shapeplan cache import cache.tar.gz --cache-dir /var/cache/shapeplan
    shapeplan cache merge shard-0.tar.gz shard-1.tar.gz -o cache.tar.gz
    shapeplan cache push --cache-dir /var/cache/shapeplan s3://bucket/shapeplan
    shapeplan cache pull s3://bucket/shapeplan --cache-dir /var/cache/shapeplan
    shapeplan cache ls [s3://bucket/shapeplan]

    Exit codes: 0 done, 1 unusable (missing, damaged or tampered archive or store object, non-empty target,
    missing bucket, no credentials), 2 usage error, 3 the archive or store was compiled for another environment
    (package versions, compiler flags, logical NeuronCore config): warm this machine's own cache instead.
    """


def _emit(info: Any, text: str, as_json: bool) -> None:
    click.echo(json.dumps(info.to_dict(), indent=2) if as_json else text)


def _summary(info: Any) -> str:
    compiler = info.environment.get("compiler", {})
    settings = ", ".join(f"{k}={v}" for k, v in sorted(compiler.items()) if v not in ("", None))
    if not info.shapes:  # eager (or failed) shapes only: no code was compiled in these settings
        return f"0 warmed shape(s) (nothing compiled), {len(info.files)} file(s); environment {settings}"
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
    from ..plan.targets import check_output

    check_output(output, "-o", cache_dirs=[cache_dir], regular_only=True, probe=False)
    info = export_cache(Path(cache_dir), Path(output))
    if not info.shapes:  # written all the same (an archive is also a record of the run), never silently
        click.echo(f"warning: {info.path} warms nothing: {cache_dir} holds no compiled shape (eager cpu/cuda runs "
                   "compile nothing); warm with --torch_compile true or on --device neuron, then export", err=True)
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
    from ..cache.archive_import import import_cache

    limits = _limits(max_gib, max_files, max_metadata_mib)
    run = None
    if plan_path is not None:
        from ..services.run import load_run

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
    from ..plan.targets import check_output

    check_output(output, "-o", inputs=parts, regular_only=True, probe=False)
    info = merge_archives([Path(p) for p in parts], Path(output), _limits(max_gib, max_files, max_metadata_mib))
    _emit(info, f"merged {len(parts)} archive(s): {_summary(info)} into {info.path}", as_json)


@cache_group.command("inspect")
@click.argument("archive", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the archive's environment and files as JSON.")
def inspect_command(archive: str, as_json: bool) -> None:
    """Show the environment an archive was compiled in (package versions, compiler settings), without extracting
    it."""
    from ..cache.archive import read_info

    if Path(archive).is_dir():  # a cache dir where its archive goes: say how to look into a cache dir
        raise UsageError(f"{archive} is a folder, not an archive; `shapeplan cache ls --cache-dir {archive}` lists "
                         "what a cache dir holds")
    info = read_info(Path(archive))
    if as_json:
        click.echo(json.dumps({"archive": info.path, "environment": info.environment, "files": info.files},
                              indent=2))
    else:
        from ..cache.archive import archived_plans
        from ..cache.listing import warmed_plans

        click.echo(f"{info.path}  ({len(info.files)} file(s), {_size(info.expanded)} expanded)")
        click.echo(_plans_table(warmed_plans(archived_plans(Path(archive)))))
        click.echo(_environment_lines(info.environment))


def _cache_dir(device: str | None, cache_dir: str | None) -> Path:
    """--cache-dir, else the one `warm` uses by default."""
    from ..services.run import choose_backend

    return choose_backend(device, cache_dir)[1]


def _plan_tasks(plan_path: str | None, device: str | None) -> set[str] | None:
    from ..services.run import plan_tasks
    from ..warm.backends import default_device

    return None if plan_path is None else {t.key for t in plan_tasks(plan_path, device or default_device())}


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@cache_group.command("push")
@click.argument("url")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="The warmed cache dir (default: the one `warm` uses).")
@click.option("--device", type=click.Choice(DEVICES), default=None, help="The stack whose default cache dir to push.")
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON.")
def push_command(url: str, cache_dir: str | None, device: str | None, as_json: bool) -> None:
    """Upload a warmed cache dir to the store at URL (s3://BUCKET/PREFIX, a folder, any fsspec URL).

    Uploads only the files the store lacks (it holds each once, under its sha256), then one new manifest naming
    them: pushes from several hosts at once (fleet shards) are safe. Credentials are the filesystem's own (s3fs:
    AWS_PROFILE, AWS_ENDPOINT_URL, the instance role).
    """
    from ..cache.store import check_store_url, push

    check_store_url(url)  # before anything is looked up
    result = push(_cache_dir(device, cache_dir), url)
    _emit(result, f"pushed {result.shapes} warmed shape(s), {result.files} file(s) to {url}: {result.uploaded} "
                  f"new object(s), {_size(result.uploaded_bytes)} uploaded (manifest {result.manifest})", as_json)


@cache_group.command("pull")
@click.argument("url")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="The cache dir to fill (new, or a cache dir; default: the one `warm` uses).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="Pull only the pushes that hold this plan's shapes.")
@click.option("--device", type=click.Choice(DEVICES), default=None,
              help="The compiler stack to check against. Default: the store's.")
@click.option("--json", "as_json", is_flag=True, help="Print what was pulled as JSON.")
@limit_options
def pull_command(url: str, cache_dir: str | None, plan_path: str | None, device: str | None, as_json: bool,
                 max_gib: float, max_files: int, max_metadata_mib: float) -> None:
    """Download from the store at URL what the cache dir lacks, checked, all or nothing.

    Only files the cache dir lacks are downloaded (a second pull of an unchanged store reads only manifests).
    Refused, nothing written: the store holds nothing compiled for this machine's package versions and compiler
    settings (exit 3); an object does not match its sha256, a manifest is damaged or names a path outside the
    cache dir, the limits below, a missing bucket, no credentials (1). A killed pull leaves the cache dir as it
    was; run it again to complete it.
    """
    from ..cache.store import check_store_url
    from ..cache.store_pull import pull

    check_store_url(url)  # before the plan is read
    result = pull(url, _cache_dir(device, cache_dir), device=device, tasks=_plan_tasks(plan_path, device),
                  limits=_limits(max_gib, max_files, max_metadata_mib))
    _emit(result, f"pulled {url} into {result.cache_dir}: {result.used} of {result.manifests} push(es) for this "
                  f"environment, {result.downloaded} object(s) downloaded ({_size(result.downloaded_bytes)}), "
                  f"{result.present} file(s) already present, {result.shapes} shape(s) added", as_json)


def _environment_lines(environment: dict[str, Any]) -> str:
    def settings(group: str) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(environment.get(group, {}).items()) if v not in ("", None))

    return "\n".join(f"  {group + ':':<10} {settings(group)}" for group in ("versions", "compiler"))


def _when(stamp: float | None) -> str:
    import time

    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(stamp))


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])


@cache_group.command("ls")
@click.argument("url", required=False)
@click.option("--cache-dir", "cache_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="A cache dir to list (repeatable). Default: the default cache dir of every stack that has one.")
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def ls_command(url: str | None, cache_dirs: tuple[str, ...], as_json: bool) -> None:
    """List the plans warmed into cache dirs, or, given URL, the pushes a store holds.

    Per cache dir: its files and size on disk, and per plan warmed into it the model, method, plan fingerprint
    (what `cache prune --fingerprint` takes), environment key, shapes warmed (compiled or read from the cache), eager
    (ran on cpu/cuda without torch_compile: nothing cached) and failed, and when it was last warmed (UTC); under
    the table, a warning for each plan warmed under another torch-neuronx or neuronx-cc build than this machine's
    (`verify` and `cache import` refuse those). Per store push: when and from which host, model, method,
    environment key, shapes, files and size.
    """
    if url is not None:
        _ls_store(url, as_json)
        return
    from ..cache.listing import scan_cache_dir
    from ..warm.backends import DEVICES
    from ..warm.cachedir import default_cache_dir

    for given in cache_dirs:
        if not Path(given).is_dir():
            from ..errors import CacheError

            raise CacheError(f"cache dir {given} does not exist; pass one `shapeplan warm --cache-dir` wrote (or "
                             "none, to list the default ones)")
    paths = [Path(d) for d in cache_dirs] or [p for p in map(default_cache_dir, DEVICES) if p.is_dir()]
    infos = [scan_cache_dir(path) for path in paths]
    if as_json:
        click.echo(json.dumps({"cache_dirs": [i.to_dict() for i in infos]}, indent=2))
        return
    if not infos:
        click.echo("no cache dir yet: `shapeplan warm` creates one (pass --cache-dir to list another)")
    for info in infos:
        locks = f", {info.locks} lock file(s), {info.stale_locks} stale" if info.locks else ""
        click.echo(f"{info.path}  ({info.files} file(s), {_size(info.size_on_disk)}{locks})")
        click.echo(_plans_table(info.plans))
        for p in info.plans:  # warmed under another torch-neuronx or neuronx-cc build than this machine's
            if p.warning:
                click.echo(f"  warning: plan {p.plan or '-'} ({p.model or '-'}, {p.method or '-'}): {p.warning}")


def _plans_table(plans: Sequence[Any]) -> str:
    rows = [(p.model or "-", p.method or "-", p.plan or "-", p.environment, str(p.warmed), str(p.eager),
             str(p.failed), _when(p.last_warmed)) for p in plans]
    return _table(("MODEL", "METHOD", "PLAN", "ENVIRONMENT", "WARMED", "EAGER", "FAILED", "LAST WARMED"), rows) \
        if rows else "  no warmed plans"


def _ls_store(url: str, as_json: bool) -> None:
    from ..cache.store import read_manifests

    pushes = read_manifests(url)
    if as_json:
        click.echo(json.dumps({"url": url, "pushes": [p.to_dict() for p in pushes]}, indent=2))
        return
    click.echo(f"{url}  ({len(pushes)} push(es), {_size(sum(p.bytes for p in pushes))} named)")
    rows = []
    for p in pushes:
        sections = [s["environment"] for s in p.shapes.values()]
        rows.append((_when(p.pushed_at), p.host, ", ".join(sorted({str(e.get("model", "-")) for e in sections})) or "-",
                     ", ".join(sorted({str(e.get("method", "-")) for e in sections})) or "-",
                     p.name.split("/", 1)[0], str(len(p.warmed())), str(len(p.files)), _size(p.bytes)))
    click.echo(_table(("PUSHED", "HOST", "MODEL", "METHOD", "ENVIRONMENT", "SHAPES", "FILES", "SIZE"), rows)
               if rows else "  no pushes")
    for key, environment in {p.name.split("/", 1)[0]: p.environment for p in pushes}.items():
        click.echo(f"environment {key}:\n{_environment_lines(environment)}")


def _fingerprint_of(plan_file: str) -> str:
    """The fingerprint `warm` recorded for the plan in `plan_file`. A value that is no file but a fingerprint (hex,
    as `cache ls` prints it) is taken as one, as `--plan` took before `--fingerprint` existed."""
    import re

    from ..errors import UsageError
    from ..plan.io import load_plan
    from ..warm.runner import plan_id

    if not Path(plan_file).exists() and re.fullmatch(r"[0-9a-f]{4,64}", plan_file):
        return plan_file
    if not Path(plan_file).exists():
        raise UsageError(f"--plan {plan_file!r}: no such plan file; pass a plan from `shapeplan analyze -o`, or a "
                         "fingerprint from `shapeplan cache ls` with --fingerprint")
    return plan_id(load_plan(plan_file))


def _age(text: str) -> float:
    """'30d', '12h', '90m' or a number of days, in seconds."""
    import math

    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "d")
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):  # NaN would compare false with every time: nothing, silently
        raise UsageError(f"--older-than {text!r} is not an age; pass one such as 30d, 12h or 90m (a bare number is "
                         "days)")
    return value * units[unit]


@cache_group.command("prune")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False, exists=True), default=None,
              metavar="DIR", help="The cache dir (default: the one `warm` uses).")
@click.option("--plan", "plan_files", multiple=True, metavar="PLAN",
              help="Remove the shapes warmed for this plan file (from `shapeplan analyze -o`); repeatable.")
@click.option("--fingerprint", "fingerprints", multiple=True, metavar="FINGERPRINT",
              help="Remove this plan's shapes by its fingerprint (the PLAN column of `cache ls`, or a prefix of it "
                   "that no other plan shares); repeatable.")
@click.option("--older-than", "older_than", default=None, metavar="AGE",
              help="Remove the shapes last warmed longer ago than AGE (30d, 12h, 90m; a bare number is days).")
@click.option("--failed", is_flag=True, help="Remove the shapes whose warm-up failed.")
@click.option("--stale-locks", "stale_locks", is_flag=True,
              help="Remove the lock files no process holds (for TorchNeuron's own, pass its lock dir, "
                   "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR or /tmp/local_cache, as --cache-dir).")
@click.option("--dry-run", is_flag=True, help="Print what would be removed, remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print what is (or would be) removed as JSON.")
def prune_command(cache_dir: str | None, plan_files: tuple[str, ...], fingerprints: tuple[str, ...],
                  older_than: str | None, failed: bool, stale_locks: bool, dry_run: bool, as_json: bool) -> None:
    """Remove a plan's shapes, the shapes older than AGE or the failed ones from a cache dir's manifests, and, with
    --stale-locks, the lock files no process holds.

    `warm` then warms them again. The compiled files go too once no warmed shape remains: the cache does not
    record which shape compiled which file, and the shapes that stay may share them.
    """
    import time

    from ..cache.listing import plan_pruning, prune
    from ..errors import UsageError

    if not plan_files and not fingerprints and older_than is None and not failed and not stale_locks:
        raise UsageError("cache prune needs --plan PLAN, --fingerprint FINGERPRINT, --older-than AGE, --failed or "
                         "--stale-locks (see `shapeplan cache ls`)")
    before = None if older_than is None else time.time() - _age(older_than)
    pruning = plan_pruning(_cache_dir(None, cache_dir), before=before,
                           plans=frozenset([*map(_fingerprint_of, plan_files), *fingerprints]), failed=failed,
                           locks=stale_locks)
    if not dry_run:
        prune(pruning)
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, **pruning.to_dict()}, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for name, key, task in pruning.entries:
        click.echo(f"{verb}: {task}  (environment {key}, {name})")
    click.echo(f"{verb} {len(pruning.entries)} shape(s) and {len(pruning.files)} file(s) "
               f"({_size(pruning.freed)}) from {pruning.cache_dir}; {pruning.kept} warmed shape(s) kept"
               + ("" if not pruning.entries or pruning.files else " with the compiled files they may share")
               + (f"; {verb} {len(pruning.locks)} stale lock file(s)" if stale_locks else ""))
