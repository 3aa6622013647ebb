"""docs/fleet.md's recipes parse: the Kubernetes manifest loads as an Indexed Job with the cache on a shared volume,
the AWS Batch job definition as JSON, and every shell script passes `bash -n`."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from tests.conftest import ROOT

FLEET = ROOT / "docs" / "fleet.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", FLEET.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_kubernetes_indexed_job_loads() -> None:
    (text,) = _blocks("yaml")
    job = yaml.safe_load(text)
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    completions = job["spec"]["completions"]
    pod = job["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--shard-count") + 1] == str(completions)  # Kubernetes exports no count
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] in mounts)
    cache = command[command.index("--cache-dir") + 1]
    assert any(cache.startswith(path) for path in mounts.values())


def test_aws_batch_job_definition_loads() -> None:
    (text,) = _blocks("json")
    definition = json.loads(text)
    container = definition["containerProperties"]
    assert container["command"][:2] == ["shapeplan", "warm"] and "--shard" not in container["command"]
    assert container["mountPoints"][0]["sourceVolume"] == container["volumes"][0]["name"]


def test_shell_recipes_pass_bash_n() -> None:
    scripts = _blocks("bash")
    assert any("#SBATCH --array=0-7" in s for s in scripts)
    assert any("cache merge" in s and "verify" in s and "cache import" in s for s in scripts)
    for script in scripts:
        checked = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
        assert checked.returncode == 0, (script, checked.stderr)
