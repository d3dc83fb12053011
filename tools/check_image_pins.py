"""Check that every container image a rendered deployment runs is pinned by digest.

    kubectl kustomize YOUR-KUSTOMIZATION | python tools/check_image_pins.py
    python tools/check_image_pins.py rendered.yaml

ascend-guard publishes no image, so deploy/ cannot name a digest: the overlays name
`ascend-guard-sidecar:0.1.0`, which your kustomization replaces with the image you built and
pushed, by digest:

    images:
      - name: ascend-guard-sidecar
        newName: REGISTRY/ascend-guard-sidecar
        digest: sha256:<the digest your registry gave the push>

(`kustomize edit set image ascend-guard-sidecar=REGISTRY/ascend-guard-sidecar@sha256:...` writes
the same). This check, run on the render in CI, exits 1 and names every container (kind/name,
container) whose image is a tag, so a tag that moves cannot reach a node unnoticed; 0 when all
are pinned. tests/unit/deploy/test_image_pins.py runs it on the shipped overlays (unpinned) and
on a kustomization that pins them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _pod_specs(doc: dict) -> Iterator[dict]:
    spec = doc.get("spec") or {}
    if doc.get("kind") == "Pod":
        yield spec
    template = (spec.get("jobTemplate") or {}).get("spec", spec).get("template") or {}
    if template.get("spec"):
        yield template["spec"]


def unpinned(docs: Iterable[dict]) -> list[str]:
    """'Kind/name container: image' for each container image that carries no digest."""
    out = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        for pod in _pod_specs(doc):
            for key in ("initContainers", "containers", "ephemeralContainers"):
                for c in pod.get(key) or []:
                    image = str(c.get("image", ""))
                    if not DIGEST.search(image):
                        out.append(f"{where} {c.get('name')}: {image or '(no image)'}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = Path(argv[0]).read_text(encoding="utf-8") if argv else sys.stdin.read()
    docs = list(yaml.safe_load_all(text))
    found = unpinned(docs)
    containers = sum(
        len(p.get(k) or [])
        for d in docs
        if isinstance(d, dict)
        for p in _pod_specs(d)
        for k in ("initContainers", "containers", "ephemeralContainers")
    )
    if found:
        print(f"{len(found)} of {containers} container image(s) not pinned by digest:")
        for line in found:
            print(f"  {line}")
        print(
            "next: in your kustomization, `images:` with `digest: sha256:...` for each "
            "(tools/check_image_pins.py's docstring)"
        )
        return 1
    print(f"all {containers} container image(s) pinned by digest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
