"""Write deploy/schemas/*.json from prometheus-operator's CRD definitions (Apache-2.0).

    python tools/vendor_crd_schemas.py CRD_DIR   # CRD_DIR = example/prometheus-operator-crd

Takes each CRD's v1 openAPIV3Schema as a JSON schema, pins apiVersion and kind, and forbids
fields the schema does not declare (what `kubectl apply --validate=strict` does), so a typo in a
manifest fails the offline check, and rewrites the one case-insensitive `(?i)` pattern in ECMA-262
form. See deploy/schemas/README.md for the source version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "podmonitors": "PodMonitor",
    "servicemonitors": "ServiceMonitor",
    "prometheusrules": "PrometheusRule",
}


def _ecma_pattern(pattern: str) -> str:
    """JSON schema patterns are ECMA-262: no inline (?i); spell the letters in both cases."""
    if "(?i)" not in pattern:
        return pattern
    body = pattern.replace("(?i)", "")
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in body)


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = _ecma_pattern(node["pattern"])
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    kind = crd["spec"]["names"]["kind"]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "monitoring.coreos.com/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted(
        {*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"}
    )
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"{kind} (monitoring.coreos.com/v1)",
        **schema,
    }


def main(argv: list[str]) -> int:
    crd_dir = Path(argv[0])
    for plural, kind in KINDS.items():
        crd = yaml.safe_load((crd_dir / f"monitoring.coreos.com_{plural}.yaml").read_text())
        assert crd["spec"]["names"]["kind"] == kind, crd["spec"]["names"]
        out = ROOT / "deploy" / "schemas" / f"{kind.lower()}-monitoring.coreos.com-v1.json"
        out.write_text(json.dumps(schema_of(crd), indent=1, sort_keys=True) + "\n")
        print(
            out.relative_to(ROOT),
            crd["metadata"].get("annotations", {}).get("operator.prometheus.io/version"),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
