"""Images pinned by digest: tools/check_image_pins.py on real `kubectl kustomize` renders.

ascend-guard publishes no image, so deploy/ ships a tag (`ascend-guard-sidecar:0.1.0`) and the
knob to pin it: the `images:` transformer, given a digest by your kustomization (what
`kustomize edit set image NAME=REGISTRY/NAME@sha256:...` writes). Here: the overlays as shipped
are reported unpinned, naming each container; a kustomization over them that sets digests pins
every container image, the DaemonSet's init container and the in-pod sidecar included (no image
escapes the transformer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.test_deploy import DEPLOY, _tool
from tools import check_image_pins

ROOT = Path(__file__).resolve().parents[3]
DIGEST = "sha256:" + "0123456789abcdef" * 4
# the images each render runs: ours, and the example workload's own vLLM image
PINNED = {
    "overlays/daemonset": ("ascend-guard-sidecar",),
    "examples/in-pod": ("ascend-guard-sidecar", "vllm-ascend-guarded"),
    "examples/daemonset": ("vllm-ascend-guarded",),
}


def _kustomize(directory: Path) -> str:
    proc = subprocess.run(
        [_tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_image_pins.py")],
        input=text, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("target", sorted(PINNED))
def test_shipped_renders_are_reported_unpinned_naming_each_container(target):
    proc = _check(_kustomize(DEPLOY / target))
    assert proc.returncode == 1, proc.stdout
    assert "not pinned by digest" in proc.stdout and "digest: sha256:" in proc.stdout
    if target == "overlays/daemonset":
        assert "DaemonSet/ascend-guard sidecar: ascend-guard-sidecar:0.1.0" in proc.stdout


@pytest.mark.parametrize("target", sorted(PINNED))
def test_a_kustomization_with_digests_pins_every_image(target, tmp_path):
    overlay = tmp_path / "mine"
    overlay.mkdir()
    images = [
        {"name": name, "newName": f"registry.example/{name}", "digest": DIGEST}
        for name in PINNED[target]
    ]
    # kustomize takes bases by relative path only
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / target, overlay)],
        "images": images,
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    rendered = _kustomize(overlay)
    proc = _check(rendered)
    assert proc.returncode == 0, proc.stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    images_run = {
        c["image"]
        for d in docs
        for pod in check_image_pins._pod_specs(d)
        for key in ("initContainers", "containers")
        for c in pod.get(key) or []
    }
    assert images_run == {f"registry.example/{name}@{DIGEST}" for name in PINNED[target]}


def test_the_check_reads_every_pod_template_kind():
    pod = {"containers": [{"name": "c", "image": "x:1"}], "initContainers": [{"name": "i", "image": f"y@{DIGEST}"}]}  # fmt: skip
    docs = [
        {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": pod}}},
        {"kind": "CronJob", "metadata": {"name": "j"},
         "spec": {"jobTemplate": {"spec": {"template": {"spec": pod}}}}},
        {"kind": "Pod", "metadata": {"name": "p"}, "spec": pod},
        {"kind": "ConfigMap", "metadata": {"name": "m"}, "data": {"image": "z:1"}},
    ]  # fmt: skip
    assert check_image_pins.unpinned(docs) == [
        "Deployment/d c: x:1",
        "CronJob/j c: x:1",
        "Pod/p c: x:1",
    ]
