"""The files in ``cluster/`` are well formed and say what the README says they do."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from engine.cli.parser import build_parser
from engine.cli.submit import prepare_entrypoint, validate_dpfl_args

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "ray-cluster-gpu.yaml"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
PVC = CLUSTER / "kuberay" / "results-pvc.yaml"
RAY_IMAGE = re.compile(r"^rayproject/ray:(\d+)\.(\d+)\.(\d+)(-py3\d+)?(-gpu|-cu\d+)?$")


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and data, path
    return data


def installed_ray() -> tuple[int, int]:
    major, minor = ray.__version__.split(".")[:2]
    return int(major), int(minor)


def pod_templates(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Pod specs of a RayCluster spec: the head's, then each worker group's."""
    return [spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in spec["workerGroupSpecs"]
    ]


def test_every_yaml_file_parses() -> None:
    files = sorted(CLUSTER.rglob("*.yaml")) + sorted(CLUSTER.rglob("*.yml"))
    assert {LAUNCHER, RAYCLUSTER, RAYJOB, PVC} <= set(files)
    for path in files:
        load(path)


# -- cluster launcher ------------------------------------------------------------------


def test_launcher_passes_rays_schema_and_has_a_gpu_worker_type() -> None:
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load(LAUNCHER)
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type"):
        assert key in raw, key
    config = prepare_config(copy.deepcopy(raw))  # Ray's own defaults and checks
    validate_config(config)
    types = config["available_node_types"]
    head = config["head_node_type"]
    assert head in types and types[head]["resources"].get("GPU", 0) == 0
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu_types, "no worker type with GPUs"
    for name, t in gpu_types.items():
        assert name != head
        assert 0 <= t.get("min_workers", 0) <= t["max_workers"] <= config["max_workers"]
        assert t["max_workers"] >= 1
        assert t["node_config"]["InstanceType"].startswith(("g", "p")), name  # GPU families


def test_launcher_installs_this_checkout_and_starts_ray_with_dashboard_and_metrics() -> None:
    raw = load(LAUNCHER)
    synced = [remote for remote, local in raw["file_mounts"].items() if local == "."]
    assert synced, "the checkout is not copied to the nodes"
    installs = [c for c in raw["setup_commands"] if "pip install" in c]
    assert any(c.split()[-1] in synced for c in installs), installs
    head = " ".join(raw["head_start_ray_commands"])
    workers = " ".join(raw["worker_start_ray_commands"])
    assert "ray start --head" in head and "--port=6379" in head
    assert "--dashboard-host=0.0.0.0" in head
    assert "--address=$RAY_HEAD_IP:6379" in workers
    for cmds in (head, workers):
        assert re.search(r"--metrics-export-port=\d+", cmds), cmds
    assert "/mnt/shared" in " ".join(raw["initialization_commands"])
    assert any("/mnt/shared:/mnt/shared" in o for o in raw["docker"]["run_options"])


# -- KubeRay ---------------------------------------------------------------------------


def check_ray_cluster_spec(spec: dict[str, Any]) -> None:
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert "metrics-export-port" in spec["headGroupSpec"]["rayStartParams"]
    gpu_groups = []
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for container in group["template"]["spec"]["containers"]:
            res = container["resources"]
            gpus = int(res["limits"].get("nvidia.com/gpu", 0))
            if gpus:
                # Kubernetes requires an extended resource's request to equal its limit.
                assert int(res["requests"]["nvidia.com/gpu"]) == gpus
                gpu_groups.append(group["groupName"])
    assert gpu_groups, "no worker group requests nvidia.com/gpu"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"dashboard": 8265, "gcs-server": 6379}.items() <= {
        p["name"]: p["containerPort"] for p in head["ports"]
    }.items()


def results_mounts(spec: dict[str, Any]) -> set[str]:
    """Mount paths of the results claim, which every Ray pod must have."""
    claim = load(PVC)["metadata"]["name"]
    paths = []
    for pod in pod_templates(spec):
        names = {
            v["name"] for v in pod["volumes"] if v["persistentVolumeClaim"]["claimName"] == claim
        }
        mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        own = {
            m["mountPath"]
            for c in pod["containers"]
            for m in c["volumeMounts"]
            if m["name"] in names
        }
        assert own and own <= mounts, pod
        paths.append(own)
    assert all(p == paths[0] for p in paths), paths
    return paths[0]


def test_pvc_is_shared_between_nodes() -> None:
    pvc = load(PVC)
    assert pvc["kind"] == "PersistentVolumeClaim"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_raycluster() -> None:
    rc = load(RAYCLUSTER)
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    check_ray_cluster_spec(rc["spec"])
    assert results_mounts(rc["spec"]) == {"/mnt/results"}


def test_rayjob_runs_a_valid_dpfl_tune_into_the_shared_volume() -> None:
    job = load(RAYJOB)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    entrypoint = spec["entrypoint"]
    assert entrypoint.startswith("dpfl ")
    args = shlex.split(entrypoint)[1:]
    ns = build_parser().parse_args(args)
    assert ns.command == "tune"
    validate_dpfl_args(args, ROOT)  # config keys and values, absolute --out
    assert "ray.address=auto" in ns.set  # a job's driver attaches to its cluster
    (mount,) = results_mounts(spec["rayClusterSpec"])
    assert Path(ns.out).is_relative_to(mount)
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert any("dpfl" in p for p in runtime_env["pip"])  # the project is installed
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] >= 0
    check_ray_cluster_spec(spec["rayClusterSpec"])


# -- versions and documented commands --------------------------------------------------


def test_images_match_the_installed_ray() -> None:
    want = installed_ray()
    launcher = load(LAUNCHER)
    images = [launcher["docker"]["image"]]
    versions = []
    for path in (RAYCLUSTER, RAYJOB):
        doc = load(path)
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        versions.append(spec["rayVersion"])
        images += [c["image"] for pod in pod_templates(spec) for c in pod["containers"]]
    for image in images:
        m = RAY_IMAGE.match(image)
        assert m, f"{image}: not a rayproject/ray:X.Y.Z image"
        assert (int(m[1]), int(m[2])) == want, f"{image} vs installed ray {ray.__version__}"
    for v in versions:
        assert tuple(int(x) for x in v.split(".")[:2]) == want, v


def documented_submits() -> list[tuple[str, str]]:
    """Every ``dpfl submit ... -- ...`` command in cluster/README.md and YAML comments."""
    found = []
    for path in [CLUSTER / "README.md", *sorted(CLUSTER.rglob("*.yaml"))]:
        text = path.read_text()
        if path.suffix == ".yaml":
            text = "\n".join(
                ln.strip().lstrip("#").strip() for ln in text.splitlines() if ln.strip()
            )
        text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
        for line in text.splitlines():
            at = line.find("dpfl submit")
            command = line[at:].split("`")[0].strip()
            if at >= 0 and " -- " in command:  # a whole command, not prose naming it
                found.append((path.name, command))
    return found


def test_documented_submit_commands_are_valid() -> None:
    commands = documented_submits()
    assert len(commands) >= 5, commands
    for source, command in commands:
        argv = shlex.split(command, comments=True)
        ns = build_parser().parse_args(argv[1:])
        assert ns.command == "submit", (source, command)
        prepare_entrypoint(ns.entrypoint, ROOT)  # raises ConfigError naming the problem
