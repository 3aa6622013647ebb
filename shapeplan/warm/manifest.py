"""The manifest: the cache dir's record of warmed shapes, per environment.

A shape enters `shapeplan-manifest.json`, atomically and under a lock, only after its step finished, so a run
killed mid-shape leaves the manifest as it was and the next run redoes that shape (the compile caches write their
own entries atomically too). Its environment key is the hash of everything besides the shapes that decides what is
compiled: versions, compiler settings, world size, dtype, model and config.

Shard I of N (`warm --shard`) records into its own `shapeplan-manifest.<I>-of-<N>.json`: on a shared file system
(FSx, EFS) no lock then spans hosts. Readers (the skip check, `--status`, `cache export`) merge every manifest file
of the cache dir (`read_merged`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..adapters.host import installed_only, installed_versions
from ..errors import CacheError, CacheMismatchError, UsageError
from ..plan.io import write_atomic
from .model import ManifestEntry, Task

if TYPE_CHECKING:
    from .shards import Shard

MANIFEST = "shapeplan-manifest.json"
MANIFEST_SCHEMA = 1
_SHARD_MANIFEST = re.compile(r"shapeplan-manifest\.(\d+)-of-(\d+)\.json")
WARMED = ("compiled", "cached", "eager")
# The warmed shapes whose code is in the cache: an eager (cpu/cuda) shape ran, which a re-run may skip, but cached
# nothing, so the cache's books (`cache ls`, `inspect`, `export`) count it apart.
COMPILED = ("compiled", "cached")


def manifest_name(shard: Shard | None) -> str:
    """The manifest file a process records into: the shard's own, else the cache dir's plain one."""
    return MANIFEST if shard is None else f"shapeplan-manifest.{shard.index}-of-{shard.count}.json"


def manifest_files(cache_dir: Path) -> list[Path]:
    """Every manifest file of `cache_dir`: the plain one first, then the shards' by shard."""
    shards = sorted((tuple(int(n) for n in m.groups()), path)
                    for path in cache_dir.glob("shapeplan-manifest.*-of-*.json")
                    if (m := _SHARD_MANIFEST.fullmatch(path.name)) and path.is_file())
    plain = cache_dir / MANIFEST
    return ([plain] if plain.is_file() else []) + [path for _, path in shards]


def environment_key(environment: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(environment, sort_keys=True, default=str).encode()).hexdigest()[:16]


def manifest_well_formed(data: dict[str, Any]) -> bool:
    """{"environments": {key: {"environment": {...}, "shapes": {task: {"status": str, ...}}}}}"""
    environments = data.get("environments")
    if not isinstance(environments, dict):
        return False
    for section in environments.values():
        if not (isinstance(section, dict) and isinstance(section.get("environment"), dict)
                and isinstance(section.get("shapes"), dict)):
            return False
        if not all(isinstance(e, dict) and isinstance(e.get("status"), str) for e in section["shapes"].values()):
            return False
    return True


class Manifest:
    """The cache dir's record of warmed shapes, per environment."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = self._read()

    def _read(self) -> dict[str, Any]:
        for path in (self.path, Path(f"{self.path}.lock")):
            if path.exists() and not path.is_file():  # found before any compile, not when the first shape is done
                raise CacheError(f"manifest {path} is not a file; remove it, or pass another --cache-dir")
        if not self.path.is_file():
            return {"schema": MANIFEST_SCHEMA, "environments": {}}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CacheError(f"manifest {self.path} is unreadable ({exc.strerror}); delete it to re-warm this cache "
                             "dir") from exc
        except (ValueError, RecursionError) as exc:  # bad JSON, bytes that are not UTF-8, nested past the parser
            raise CacheError(f"manifest {self.path} is not UTF-8 JSON ({exc}); delete it to re-warm this cache dir") \
                from exc
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise CacheError(f"manifest {self.path} has an unknown schema; delete it to re-warm this cache dir")
        if not manifest_well_formed(data):
            raise CacheError(f"manifest {self.path} does not have a manifest's structure; delete it to re-warm this "
                             "cache dir")
        return data

    def done(self, environment: str, task: Task) -> bool:
        entry = self.data["environments"].get(environment, {}).get("shapes", {}).get(task.key)
        return entry is not None and entry.get("status") in WARMED

    def record(self, entry: ManifestEntry, environment: dict[str, Any]) -> None:
        """Add `entry` under a lock, to the manifest as it is on disk: other processes (workers, ranks) record
        into the same manifest."""
        from .parallel import locked

        try:
            with locked(self.path):
                self.data = self._read()
                section = self.data["environments"].setdefault(entry.environment,
                                                               {"environment": environment, "shapes": {}})
                section["shapes"][entry.task] = entry.to_dict()
                write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise CacheError(f"cannot write manifest {self.path}: {exc.strerror}; free space there "
                             "or pass a writable --cache-dir, then warm again") from exc


    def add_sections(self, environments: dict[str, dict[str, Any]]) -> int:
        """Add, under a lock and in one write, the warmed shapes of `environments` ({key: {"environment",
        "shapes"}}, as `read_merged` gives them) this manifest does not record as warmed; returns how many."""
        from .parallel import locked

        added = 0
        try:
            with locked(self.path):
                self.data = self._read()
                for key, section in environments.items():
                    held = self.data["environments"].setdefault(key, {"environment": section["environment"],
                                                                      "shapes": {}})
                    for task, entry in section["shapes"].items():
                        if entry["status"] in WARMED and held["shapes"].get(task, {}).get("status") not in WARMED:
                            held["shapes"][task] = {k: v for k, v in entry.items() if k != "shard"}
                            added += 1
                if added:
                    write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise CacheError(f"cannot write manifest {self.path}: {exc.strerror}; pass a writable --cache-dir") \
                from exc
        return added


    def remove(self, entries: set[tuple[str, str]]) -> None:
        """Drop the (environment key, task key) `entries`, under the lock, in one write (`cache prune`)."""
        from .parallel import locked

        try:
            with locked(self.path):
                self.data = self._read()
                for key, task in entries:
                    self.data["environments"].get(key, {}).get("shapes", {}).pop(task, None)
                self.data["environments"] = {k: s for k, s in self.data["environments"].items() if s["shapes"]}
                write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise CacheError(f"cannot write manifest {self.path}: {exc.strerror}; pass a writable --cache-dir") \
                from exc


# The packages whose versions a cache archive records and an import checks against this machine.
MACHINE_PACKAGES = ("torch", "trl", "transformers", "accelerate")


def machine_environment(device: str) -> dict[str, Any]:
    """This machine's versions and compiler settings, as the warm-up records them."""
    from .backends import make_backend

    try:
        if device == "neuron":  # as a torch_compile warm-up records it; `mismatches` takes an eager one's part
            from .backends.neuron import NeuronBackend

            neuron = NeuronBackend()
            neuron.torch_compile = True
            compiler = neuron.settings()
        else:
            compiler = make_backend(device).settings()
    except UsageError as exc:  # e.g. a neuron cache on a machine without torch-neuronx
        raise CacheMismatchError(f"this machine cannot use a {device} cache: {exc}") from None
    versions = {name: version or "none" for name, version in installed_versions(MACHINE_PACKAGES).items()}
    return {"versions": versions, "compiler": compiler}


def mismatches(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """'name=recorded (this machine: value)' for every version or compiler setting that differs."""
    from .backends.neuron import SOURCE_PATHS, eager_settings, version_notes

    out = []
    for group in ("versions", "compiler"):
        a, b = recorded.get(group) or {}, here.get(group) or {}
        if group == "compiler" and b.get("backend") == "neuron" and SOURCE_PATHS[0] not in a:  # an eager cache
            b = eager_settings(b)
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                out.append(f"{name}={a.get(name, '<unset>')!s} (this machine: {b.get(name, '<unset>')!s})")
        if group == "compiler" and b.get("backend") == "neuron":  # another build: said why it is not used here
            out += version_notes(a, b)
    if any(item.startswith(SOURCE_PATHS) for item in out):
        out.append("compiled graphs' NEFF keys hold their source file paths: install at the warm-up's paths "
                   "(docs/bake.md)")
    return out


def other_build(environment: dict[str, Any]) -> list[str]:
    """Why shapes warmed in `environment` do not serve this machine's torch-neuronx or neuronx-cc build, read from the
    installed distributions (nothing is imported); [] where they match, or where this machine has neither."""
    from .backends.neuron import version_notes

    compiler = environment.get("compiler") or {}
    if compiler.get("backend") != "neuron":
        return []
    return version_notes(compiler, installed_only(("torch-neuronx", "neuronx-cc")))


def refuse_other_environment(cache_dir: Path, device: str) -> None:
    """Refuse a cache dir whose manifests hold shapes warmed only in other environments (versions, compiler
    settings, TorchNeuron's execution mode) than this machine's: running its shapes here proves nothing about it."""
    recorded = [section["environment"] for section in read_merged(cache_dir).environments.values()]
    if not recorded:
        return
    here = machine_environment(device)
    differences = [mismatches(environment, here) for environment in recorded]
    if all(differences):
        closest = min(differences, key=len)
        raise CacheMismatchError(f"{cache_dir} was warmed in another environment: {'; '.join(closest)}; run with "
                                 "the warm-up's settings, or warm this cache dir here with `shapeplan warm`",
                                 differences=closest)


def _shard_of(path: Path) -> str | None:
    """"I/N" for a shard's manifest file, None for the plain one."""
    match = _SHARD_MANIFEST.fullmatch(path.name)
    return f"{match[1]}/{match[2]}" if match else None


@dataclass(frozen=True, slots=True)
class MergedManifest:
    """Every manifest file of a cache dir as one: per environment key, its environment and, per task key, the entry
    that warmed it (a warmed entry wins over a failed one, then the first file), with "shard": the "I/N" whose
    manifest holds it (None: the plain manifest)."""

    files: tuple[Path, ...]
    environments: dict[str, dict[str, Any]]

    def done(self, environment: str, task: Task) -> bool:
        entry = self.environments.get(environment, {}).get("shapes", {}).get(task.key)
        return entry is not None and entry["status"] in WARMED


def read_merged(cache_dir: Path) -> MergedManifest:
    files = manifest_files(cache_dir)
    environments: dict[str, dict[str, Any]] = {}
    for path in files:
        shard = _shard_of(path)
        for key, section in Manifest(path).data["environments"].items():
            merged = environments.setdefault(key, {"environment": section["environment"], "shapes": {}})
            for task, entry in section["shapes"].items():
                held = merged["shapes"].get(task)
                if held is None or (held["status"] not in WARMED and entry["status"] in WARMED):
                    merged["shapes"][task] = {**entry, "shard": shard}
    return MergedManifest(tuple(files), environments)


def check_same_peft(merged: MergedManifest, environment: dict[str, Any], source: str = "the cache dir") -> None:
    """Refuse (CacheMismatchError) `source`, a cache dir or archive, warmed for this method and model with other PEFT
    settings only: a LoRA run's graphs (adapter matmuls, a reference forward with the adapters off) are not a full
    fine-tune's, nor another rank's, alpha's or target modules'."""
    from ..adapters.lora import describe

    same_run = [s["environment"] for s in merged.environments.values()
                if s["environment"].get("method") == environment.get("method")
                and s["environment"].get("model") == environment.get("model")]
    run = environment.get("peft")
    if same_run and all(e.get("peft") != run for e in same_run):
        raise CacheMismatchError(f"{source} was warmed for {describe(same_run[0].get('peft'))}, this run trains "
                                 f"{describe(run)}: other graphs; warm it with the run's PEFT options "
                                 "(`shapeplan warm --plan PLAN`)", warmed=same_run[0].get("peft"), run=run)


@dataclass(frozen=True, slots=True)
class PlanStatus:
    """How far the merged manifests are with a plan: per task key, where it was warmed ([{"environment": key,
    "shard": "I/N" or None, "status": ...}]); the plan is complete when one environment holds every task."""

    tasks: dict[str, str]  # task key -> label, in plan order
    done: dict[str, list[dict[str, Any]]]
    environments: dict[str, dict[str, Any]]  # environment key -> environment
    complete_in: tuple[str, ...]  # the environment keys that hold every task

    @property
    def missing(self) -> list[str]:
        """Task keys no environment holds."""
        return [key for key in self.tasks if not self.done[key]]

    @property
    def complete(self) -> bool:
        return bool(self.complete_in)

    def to_dict(self) -> dict[str, Any]:
        return {"complete": self.complete, "complete_in": list(self.complete_in),
                "environments": self.environments,
                "shapes": [{"key": key, "label": label, "done": self.done[key]} for key, label in self.tasks.items()],
                "missing": self.missing}


def plan_status(tasks: list[Task], merged: MergedManifest) -> PlanStatus:
    """The plan's tasks against `merged`. An environment completes the plan when it holds every task compiled or
    cached: a shape that ran eager (cpu/cuda without torch_compile) is listed as done there, but it left nothing in
    the cache for training to hit, so eager shapes complete nothing."""
    done: dict[str, list[dict[str, Any]]] = {t.key: [] for t in tasks}
    for env_key, section in merged.environments.items():
        for task in tasks:
            entry = section["shapes"].get(task.key)
            if entry is not None and entry["status"] in WARMED:
                done[task.key].append({"environment": env_key, "shard": entry["shard"], "status": entry["status"]})
    complete_in = tuple(key for key in merged.environments
                        if all(any(d["environment"] == key and d["status"] in COMPILED for d in done[t.key])
                               for t in tasks))
    used = {d["environment"] for entries in done.values() for d in entries}
    return PlanStatus(tasks={t.key: t.label for t in tasks}, done=done,
                      environments={k: s["environment"] for k, s in merged.environments.items() if k in used},
                      complete_in=complete_in)


def differences_from_here(status: PlanStatus, device: str) -> list[str]:
    """Where a plan is complete only in environments other than this machine's: the closest one's differences
    (`mismatches`); empty where one of them is this machine's, or where this machine cannot use the device's caches
    and so cannot tell (a coordinator without Neuron devices)."""
    try:
        here = machine_environment(device)
    except CacheMismatchError:
        return []
    differences = [mismatches(status.environments[key], here) for key in status.complete_in]
    return min(differences, key=len) if differences and all(differences) else []
