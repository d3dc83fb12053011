"""Generate the reference tables of docs/ (and the README's compatibility table) from the code.

    python tools/gen_docs.py          # rewrite the generated blocks
    python tools/gen_docs.py --check  # exit 1 when a block differs (tests/unit/docs/test_docs.py)

- configuration: every `runtime_guard` key from the config dataclasses (guard/config/runtime_guard.py and its
  sections): type, default, allowed range or choices, and the comment above the field;
- metrics: every family the sidecar registers (telemetry/metrics/waves.py, the probe table
  telemetry/wire/probes.py, telemetry/metrics/collectives.py), read from a live registry;
- sidecar flags: every `ascend-guard sidecar` flag, its default and help, from the settings table
  the flags are generated from (telemetry/sidecar/settings.py);
- compatibility: the versions the test suite records as tested (tests/compat_record.py).

A block sits between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.drift import write_or_check  # noqa: E402 - needs ROOT on sys.path as a script


def _field_comments(cls: type) -> dict[str, str]:
    """The `# ...` lines right above each field in the class body."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


_GENERIC = {
    "enabled": "turns this part on or off",
    "action": "what a hit does: report, or dump (report plus an evidence bundle)",
}


def _section_doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().splitlines()
    return f"({doc[0].rstrip('.')})" if doc and not doc[0].startswith(cls.__name__ + "(") else ""


def _type_name(tp: object) -> str:
    if tp in (bool, int, float, str):
        return tp.__name__
    if typing.get_origin(tp) is tuple:
        return f"list of {typing.get_args(tp)[0].__name__}"
    return str(tp)


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def config_rows(cls: type | None = None, prefix: str = "") -> list[tuple[str, ...]]:
    from guard.config.runtime_guard import GuardConfig

    cls = cls or GuardConfig
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    rows = []
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(config_rows(tp, f"{key}."))
            continue
        meta = field.metadata
        allowed = ""
        if "range" in meta:
            low, high = meta["range"]
            allowed = f"{low:g} – {high:g}"
        elif "choices" in meta:
            allowed = " \\| ".join(meta["choices"])
        default = _default(field)
        if field.name == "sidecar":
            from telemetry.wire import paths

            default = paths.sidecar_address({})  # the documented default, not this shell's
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        meaning = comments.get(field.name) or _GENERIC.get(field.name) or _section_doc(cls)
        rows.append((f"`{key}`", _type_name(tp), f"`{shown}`", allowed, meaning))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def config_table() -> str:
    return _table(("key", "type", "default", "allowed", "meaning"), config_rows())


def metric_rows() -> list[tuple[str, ...]]:
    from prometheus_client import CollectorRegistry

    from telemetry.crossrank.rank_gauges import RankGauges
    from telemetry.crossrank.view import CrossRankView
    from telemetry.export.otlp import ExportSettings, OtlpExporter
    from telemetry.metrics.store import StoreMetrics
    from telemetry.metrics.waves import SidecarMetrics
    from telemetry.metrics.workload import WorkloadBook, WorkloadInfo
    from telemetry.pipeline.writer import BoundedQueue, Drops
    from telemetry.tempo_api.server import refused_counter

    registry = CollectorRegistry()
    SidecarMetrics(registry)
    CrossRankView(registry)
    registry.register(RankGauges(list))  # per-rank facts for the cross-node rules
    registry.register(WorkloadInfo(WorkloadBook()))  # each rank's Kubernetes pod
    drops = Drops(
        registry
    )  # the record path's own families (telemetry/pipeline/writer.py, export.py)
    BoundedQueue(1, drops, registry)
    OtlpExporter(ExportSettings("http://localhost:4317"), drops, registry, "docs").close()
    refused_counter(registry)  # the query API's (telemetry/tempo_api/server.py)
    from telemetry.metrics.auth import auth_refused_counter

    auth_refused_counter(registry)  # every listener's token refusals (telemetry/sidecar/app.py)
    StoreMetrics(registry)  # the store's health (telemetry/metrics/store.py)
    from telemetry.metrics.bundles import BundleMetrics

    BundleMetrics(registry)  # hang evidence bundles (telemetry/crossrank/bundle.py)
    from telemetry.metrics.requests import RequestMetrics

    registry.register(RequestMetrics())  # request membership shed by the workers
    rows = []
    for collector, names in getattr(registry, "_collector_to_names", {}).items():
        if not hasattr(collector, "_name"):  # a custom Collector: its families name themselves
            for family in collector.collect():
                shown = f"{family.name}_total" if family.type == "counter" else family.name
                labels = ", ".join(f"`{label}`" for label in getattr(family, "_labelnames", ()))
                rows.append((f"`{shown}`", family.type, labels, family.documentation))
            continue
        kind = getattr(collector, "_type", "")
        name = getattr(collector, "_name", "") or sorted(names)[0]
        shown = f"{name}_total" if kind == "counter" else name
        labels = ", ".join(f"`{label}`" for label in getattr(collector, "_labelnames", ()))
        rows.append((f"`{shown}`", kind, labels, getattr(collector, "_documentation", "")))
    return sorted(rows)


def metrics_table() -> str:
    return _table(("family", "type", "labels", "meaning"), metric_rows())


def compatibility_table() -> str:
    from tests.compat_record import TESTED

    rows = [
        (r.vllm, r.vllm_ascend or "—", r.torch_npu or "—", r.torch, r.platform, r.how)
        for r in TESTED
    ]
    return _table(
        ("vLLM", "vllm-ascend", "torch_npu", "torch", "platform", "how it is tested"), rows
    )


def sidecar_flags_table() -> str:
    """`ascend-guard sidecar`'s flags, as its --help shows them (defaults from this shell's
    environment aside: the documented default is the one with no environment set)."""
    import argparse

    from telemetry.cli.commands import sidecar
    from telemetry.wire import paths

    parser = argparse.ArgumentParser(prog="ascend-guard")
    sidecar.add_parser(parser.add_subparsers())
    (command,) = parser._subparsers._group_actions[0].choices.values()
    documented = {
        "listen": paths.sidecar_address({}),
        "store": paths.default_store({}),
        "health_port": paths.health_port({}),
    }
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in command._actions:
        if not action.option_strings or action.dest == "help":
            continue
        default = documented.get(action.dest, action.default)
        shown = "off" if default is False else "none" if default in (None, "") else f"`{default}`"
        meaning = action.help.replace("|", "\\|")
        rows.append(f"| `{action.option_strings[0]}` | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


BLOCKS = {
    "config-table": (ROOT / "docs" / "configuration.md", config_table),
    "metrics-table": (ROOT / "docs" / "metrics.md", metrics_table),
    "sidecar-flags": (ROOT / "docs" / "configuration.md", sidecar_flags_table),
    "compatibility-table": (ROOT / "docs" / "compatibility.md", compatibility_table),
    "readme-compatibility-table": (ROOT / "README.md", compatibility_table),
}


def render(text: str, name: str, body: str) -> str:
    start, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no {start} block to fill")
    return pattern.sub(lambda _m: f"{start}\n{body}{end}", text)


def main(argv: list[str] | None = None) -> int:
    def rendered() -> dict[Path, str]:
        texts: dict[Path, str] = {}
        for name, (path, make) in BLOCKS.items():
            texts[path] = render(texts.get(path, path.read_text()), name, make())
        return texts

    return write_or_check(
        argv,
        __doc__.splitlines()[0],
        rendered,
        "{names}: generated tables drifted; run `make docs`",
    )


if __name__ == "__main__":
    sys.exit(main())
