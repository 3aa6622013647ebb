"""`shapeplan doctor`: the first command to run on a new host; presentation of `shapeplan.services.doctor.diagnose`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..warm.backends import DEVICES


def render(diagnosis: Any) -> str:
    width = max(len(name) for name in diagnosis.versions) + 2
    lines = [f"{name:<{width}}{version}" for name, version in diagnosis.versions.items()]
    found = diagnosis.cores
    count = found["count"] if found["count"] is not None else "unknown"
    visible = f" ({','.join(map(str, found['visible']))})" if found["visible"] else ""
    free = f"{diagnosis.free_gib} GiB free" if diagnosis.free_gib is not None else "free space unknown"
    lines += ["", *(f"{name}: {value}" for name, value in diagnosis.host.items())]
    lines += [
        "",
        f"device: {diagnosis.device}",
        (f"cores: {count} visible {'logical NeuronCores' if diagnosis.device == 'neuron' else 'cores'}{visible}, "
         f"from {found['from']}"),
        f"cache dir: {diagnosis.cache_dir} ({free}, {'writable' if diagnosis.writable else 'NOT writable'})",
        f'pad_to_multiple_of="auto" resolves to: {diagnosis.pad_to_multiple_of} (TRL, on this device)',
        "compile-key settings (warm-up and training must match):",
        *(f"  {name}={value}" for name, value in diagnosis.settings.items()),
        "",
    ]
    for check in diagnosis.checks:
        # KNOWN: the release's known limitation, with its fix; WARN: passed, at a cost the fix avoids; neither fails
        status = "WARN" if check.passed and check.warn else "PASS" if check.passed else \
            "KNOWN" if check.known else "FAIL"
        line = f"{status}  {check.name}: {check.detail}"
        lines.append(line if status == "PASS" else f"{line}\n      fix: {check.fix}")
    lines.append("")
    known = sum(not c.passed and c.known for c in diagnosis.checks)
    warned = sum(c.passed and c.warn for c in diagnosis.checks)
    notes = [f"{known} known limitation(s) of this release"] * bool(known) + [f"{warned} warning(s)"] * bool(warned)
    lines.append(("doctor: all checks passed" if diagnosis.passed else
                  f"doctor: {sum(not (c.passed or c.known) for c in diagnosis.checks)} check(s) failed")
                 + (f" ({', '.join(notes)}, above)" if notes else ""))
    return "\n".join(lines)


@click.command("doctor")
@click.option("--device", type=click.Choice(DEVICES), default=None,
              help="The device to check. Default: the one `warm` would use.")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="The cache dir `warm` will use (default: as `warm`).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="With --device neuron: instead of the checks, probe what TorchNeuron's source does not settle "
                   "(execution mode, counters with metrics off, cache layouts, the NKI attention key, the debug and "
                   "HLO cache dirs, eager keys from another install path, the four-part versions, the cache-entry "
                   "bindings) in fresh processes and write it all to FILE as JSON, for a bug report. Under 15 "
                   "minutes on a Trn2.")
def doctor_command(device: str | None, cache_dir: str | None, as_json: bool, report_path: str | None) -> None:
    """Check this host before warming: versions, device, cores, cache dir, compile-key settings, then a self-test.

    The self-test compiles one op and one tiny torch.compile graph in a fresh process into a temporary cache dir,
    then runs the same in a second process, which must load it from the cache and compile nothing. One line per
    check, PASS or FAIL with the fix. Exit code 0 only if every check passes, 1 otherwise.

    \b
    On a Trn2, please run once and attach the report to an issue:
      shapeplan doctor --device neuron --report neuron-report.json
    """
    from ..services.doctor import diagnose, versions
    from ..warm.cachedir import cache_dir_path

    if report_path is not None:
        from ..errors import UsageError
        from ..plan.targets import check_output
        from ..warm.backends.neuron import require_torch_neuronx
        from ..warm.backends.neuron_probe import write_report

        if device != "neuron":
            raise UsageError("--report probes TorchNeuron: pass --device neuron on a Trainium host")
        check_output(report_path, "--report", cache_dirs=[cache_dir])  # before the probes' minutes
        require_torch_neuronx()
        report = write_report(Path(report_path), versions())
        click.echo(json.dumps(report["answers"], indent=2, sort_keys=True))
        click.echo(f"doctor: report written to {report_path}; attach it to your bug report")
        return
    diagnosis = diagnose(device, cache_dir_path(Path(cache_dir)) if cache_dir else None)
    click.echo(json.dumps(diagnosis.to_dict(), indent=2) if as_json else render(diagnosis))
    if not diagnosis.passed:
        raise click.exceptions.Exit(1)
