"""`ascend-guard doctor`: where the guard attaches on this host, or in a source tree.

Live mode (default) detects the platform, runner generation and versions, arms the same binder
the vLLM plugin uses, imports each module of the runtime's attach points and reports, per
attach point, whether it is bound, missing (and why) or not importable here. `--source PATH`
reads a vllm-ascend (or vLLM) checkout instead, without importing it. A point the release
cannot hold (the table's spans, e.g. upstream's V1 runner from vLLM 0.34 on) is "not in this
version", with the reason, and counts neither way. Exit status: 0 when every other attach point
that applies is bound (or found), 1 when any is not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from ascend_runtime.attach.points import (
    ATTACH_POINTS,
    COMPONENTS,
    GENERATIONS,
    NOT_IN_VERSION,
    RUNNER_SPANS,
    RUNTIMES,
    AttachPoint,
    points_for,
    runner_generations,
)
from telemetry.cli.table import render_table

OK_STATUSES = ("bound", "found")


@dataclasses.dataclass(frozen=True)
class Row:
    point: AttachPoint
    status: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        p = self.point
        return {
            "component": p.component,
            "module": p.module,
            "class": p.qualname,
            "method": p.method,
            "action": p.action,
            "runtimes": list(p.runtimes),
            "inherited": p.inherited,
            "status": self.status,
            "detail": self.detail,
        }


def _sorted(points: Sequence[AttachPoint]) -> list[AttachPoint]:
    return sorted(points, key=lambda p: (COMPONENTS.index(p.component), ATTACH_POINTS.index(p)))


def _import(module: str) -> str | None:
    """None when imported, else why not."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name) and exc.name == module.split(".")[0]:
            return f"not installed ({exc.name})"
        return f"import failed: {exc}"
    except Exception as exc:  # noqa: BLE001 - a module that cannot load here is reported, not fatal
        return f"import failed: {type(exc).__name__}: {str(exc)[:120]}"
    return None


def in_version(rows: Sequence[Row], versions: dict[str, str | None]) -> list[Row]:
    """Rows whose point is not bound or found, and that the release cannot hold (by package:
    `vllm`, `vllm_ascend`), become "not in this version" with the reason."""
    out = []
    for row in rows:
        why = None if row.status in OK_STATUSES else row.point.absent_from(versions)
        out.append(row if why is None else Row(row.point, NOT_IN_VERSION, why))
    return out


def runners_line(versions: dict[str, str | None]) -> str | None:
    """Which runner generations the vLLM release holds, and what it lost: for the header."""
    version = versions.get("vllm")
    if not version:
        return None
    held = runner_generations("vllm", version)
    gone = [
        RUNNER_SPANS[("vllm", g)].why_not(version)
        for g in GENERATIONS
        if g not in held and ("vllm", g) in RUNNER_SPANS
    ]
    return f"vllm {version} holds {', '.join(held) or 'no runner'}" + (
        f" ({'; '.join(gone)})" if gone else ""
    )


def live_rows(points: Sequence[AttachPoint], platform: str) -> list[Row]:
    from ascend_runtime.attach.binder import bind_all, binding_of

    if platform == "cpu":
        _import("vllm.v1.worker.cpu.shm")  # as the CPU worker does: MRV2 imports after it
    bind_all(points)
    import_errors = {m: _import(m) for m in dict.fromkeys(p.module for p in points)}
    rows = []
    for point in _sorted(points):
        error = import_errors[point.module]
        if error is not None:
            status = "not installed" if error.startswith("not installed") else "unavailable"
            rows.append(Row(point, status, error))
            continue
        binding = binding_of(point)
        rows.append(Row(point, binding.status, binding.reason))
    from ascend_runtime.attach.detect import installed_versions

    return in_version(rows, installed_versions())


def source_rows(points: Sequence[AttachPoint], root: str) -> list[Row]:
    from ascend_runtime.doctor.source_scan import scan_tree

    return [Row(r.point, r.status, r.detail) for r in scan_tree(root, _sorted(points))]


def _runtimes_label(point: AttachPoint) -> str:
    if set(point.runtimes) == set(RUNTIMES):
        return "all"
    return ",".join(point.runtimes)


def render(rows: Sequence[Row], *, show_runtimes: bool) -> str:
    headers = ["component", "attach point", "action", "status", "detail"]
    if show_runtimes:
        headers.insert(1, "runtimes")
    table = []
    for row in rows:
        p = row.point
        cells = [
            p.component,
            f"{p.module}.{p.qualname}.{p.method}",
            p.action,
            row.status,
            row.detail,
        ]
        if show_runtimes:
            cells.insert(1, _runtimes_label(p))
        table.append(cells)
    return render_table(headers, table)


def hang_deadline(config: Any = None) -> tuple[float | None, str]:
    """The hang watchdog's deadline and the config key it comes from, if this build has one.

    The watchdog's config section (`collectives.deadline_s`) is found by its field
    name, so the doctor works with or without it; `config` defaults to ASCEND_GUARD_CONFIG's
    config, else the defaults."""
    if config is None:
        from guard.config.runtime_guard import GuardConfig, resolve_config

        try:
            config = resolve_config(None) or GuardConfig()
        except Exception:  # noqa: BLE001 - a bad config file is `config check`'s job
            config = GuardConfig()
    for field in dataclasses.fields(config):
        section = getattr(config, field.name)
        if not dataclasses.is_dataclass(section):
            continue
        for name in ("deadline_s", "hang_deadline_s"):
            value = getattr(section, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value), f"runtime_guard.{field.name}.{name}"
    return None, ""


def hccl_lines(config: Any = None) -> tuple[dict[str, str], str | None]:
    """Header lines on HCCL and the hang deadline, and the deadline problem (None if fine)."""
    from ascend_runtime.probes.hccl import DEADLINE_FRACTION, check_hang_deadline, hccl_settings

    lines = {"hccl": "  ".join(f"{k.upper()}={v}" for k, v in hccl_settings().items())}
    deadline, key = hang_deadline(config)
    if deadline is None:
        lines["hang deadline"] = "no hang watchdog in this build"
        return lines, None
    problem = check_hang_deadline(deadline)
    lines["hang deadline"] = problem or (
        f"{deadline:g} s ({key}), below {DEADLINE_FRACTION:g} x HCCL_EXEC_TIMEOUT"
    )
    return lines, problem


def _custom_op_collectives(platform: str) -> bool:
    """Whether the platform routes collectives through vLLM's opaque custom ops
    (`torch.ops.vllm.all_reduce`, ...), which torch.compile keeps out of its graph."""
    try:
        from vllm.platforms import current_platform

        if platform == "cpu" or current_platform.device_type == platform:
            return bool(current_platform.use_custom_op_collectives())
    except Exception:  # noqa: BLE001 - no vLLM here: what vLLM's platforms declare
        pass
    return platform in ("cuda", "ascend")


def collective_lines(rows: Sequence[Row], runtime: str, config: Any = None) -> dict[str, str]:
    """How collectives are seen on `runtime`, per execution mode: per call, per replay, or not
    at all, and why (from the bound rows and the platform)."""
    if config is None:
        from guard.config.runtime_guard import GuardConfig, resolve_config

        try:
            config = resolve_config(None) or GuardConfig()
        except Exception:  # noqa: BLE001
            config = GuardConfig()
    section = getattr(config, "collectives", None)
    if section is not None and not getattr(section, "enabled", True):
        off = "not at all: runtime_guard.collectives.enabled is false"
        return {"collectives eager": off, "collectives compiled": off, "collectives graphs": off}
    if runtime == "all":
        return {}
    platform = runtime.split("-", 1)[0]

    def unbound(action: str, component: str | None = None) -> list[Row]:
        return [
            r
            for r in rows
            if r.point.action == action
            and (component is None or r.point.component == component)
            and r.status not in OK_STATUSES
        ]

    def present(action: str) -> bool:
        return any(r.point.action == action for r in rows)

    def why_not(missing: list[Row]) -> str:
        r = missing[0]
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"not at all: {r.point.qualname}.{r.point.method} {r.status}: {r.detail}{more}"

    coordinator = unbound("collective")
    eager = (
        why_not(coordinator)
        if coordinator
        else "per call: GroupCoordinator methods (host time, bytes, seq per group)"
    )
    if coordinator:
        compiled = eager
    elif present("compiled_graph"):
        missing = unbound("compiled_graph")
        kernels = (
            "vLLM's collective custom ops"
            if _custom_op_collectives(platform)
            else "the communicator's kernels (torch.compile inlines it)"
        )
        compiled = (
            why_not(missing)
            if missing
            else (
                f"per compiled-graph call: {kernels} found in each compiled graph's FX graph (op, "
                "group, bytes per batch size), all counted at each call of the graph as "
                "graph_counted; no per-call host time; a hang names the graph and its list"
            )
        )
    else:
        compiled = "not at all: no compiled-graph attach point for this runtime"
    if platform == "cpu":
        graphs = "none captured: vLLM captures no device graph on CPU"
    elif present("graph_collectives"):
        missing = unbound("graph_collectives")
        graphs = (
            why_not(missing)
            if missing
            else (
                "per replay: collectives noted at capture (op, group, bytes per batch size), "
                "counted at each replay as replayed; device time from events around the replay; "
                "no per-call host time"
            )
        )
    else:
        graphs = "not at all: no device graph attach point for this runtime"
    return {
        "collectives eager": eager,
        "collectives compiled": compiled,
        "collectives graphs": graphs,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-guard doctor",
        description="Show where the guard attaches to vLLM / vllm-ascend and whether it is bound "
        "(imports torch and vLLM here: several seconds). With --live: ask the running sidecar "
        "how complete each engine's coverage is (imports neither; "
        "`ascend-guard doctor --live --help` lists its options).",
    )
    parser.add_argument(
        "--source-tree",
        dest="source",
        default=None,
        metavar="PATH",
        help="read a vllm-ascend (or vLLM) source tree, without import (--source PATH: the old "
        "spelling)",
    )
    # handled by telemetry/cli/commands/doctor.py before this parser runs; listed for --help
    parser.add_argument(
        "--live",
        action="store_true",
        help="ask the running sidecar instead: ranks connected, attach points bound per engine",
    )
    parser.add_argument(
        "--sidecar",
        metavar="URL",
        default=None,
        help="with --live: the sidecar's health endpoint (default: the local sidecar's)",
    )
    parser.add_argument(
        "--runtime",
        default=None,
        choices=(*RUNTIMES, "all"),
        help="check this runtime's attach points (default: the one detected here; "
        "with --source: every runtime of the tree's packages)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _progress(step: str) -> None:
    """What doctor is doing, on stderr (its table and JSON go to stdout), so that the seconds
    spent importing vLLM are not silent."""
    print(f"ascend-guard doctor: {step} ...", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    from telemetry.wire import logs

    logs.configure(level="warning")  # the table is the output; skipped points are in it
    from ascend_runtime.doctor.source_scan import SourceTreeError, tree_info

    if args.source is not None:
        from pathlib import Path

        runtime = args.runtime or "all"
        try:
            rows = source_rows(points_for(runtime), args.source)
        except SourceTreeError as exc:
            print(f"ascend-guard doctor: {exc}", file=sys.stderr)
            return 2
        info = tree_info(args.source)
        header = {
            "source": str(Path(args.source).resolve()),
            "runtime": runtime,
            "versions": info,
        }
        runners = runners_line({"vllm": info.get("vllm")})
        if runners:
            header["runners"] = runners
    else:
        from ascend_runtime.attach.detect import detect

        # what vLLM and torch print while importing belongs on stderr, not in the table or JSON
        with contextlib.redirect_stdout(sys.stderr):
            _progress("importing torch and vLLM to find the runtime (several seconds)")
            info = detect()
            runtime = args.runtime or info.runtime
            points = points_for(runtime)
            _progress(f"runtime {runtime}: binding {len(points)} attach points")
            rows = live_rows(points, info.platform)
        # a table: one row per line, columns aligned (fmt: skip)
        header = {
            "platform": info.platform, "runtime": runtime, "detected_runtime": info.runtime,
            "why": info.reason, "versions": info.versions,
        }  # fmt: skip
        runners = runners_line({"vllm": info.versions.get("vllm")})
        if runners:
            header["runners"] = runners
    ok = [r for r in rows if r.status in OK_STATUSES]
    absent = [r for r in rows if r.status == NOT_IN_VERSION]
    not_ok = [r for r in rows if r.status not in (*OK_STATUSES, NOT_IN_VERSION)]
    hccl, problem = hccl_lines()
    visibility = collective_lines(rows, runtime)
    fully = not not_ok and bool(ok) and problem is None
    if args.json:
        # a table: one row per line, columns aligned (fmt: skip)
        document = {
            **header, "ok": fully, "attach_points": [r.as_dict() for r in rows],
            "hccl": hccl, "hang_deadline_problem": problem, "collectives": visibility,
        }  # fmt: skip
        print(json.dumps(document, indent=2, sort_keys=True), file=out)
        return 0 if fully else 1
    for key, value in {**header, **hccl, **visibility}.items():
        if isinstance(value, dict):
            value = "  ".join(f"{k} {v or '-'}" for k, v in value.items())
        print(f"{key}: {value}", file=out)
    print("", file=out)
    print(render(rows, show_runtimes=runtime == "all"), file=out)
    print("", file=out)
    verb = "found" if args.source is not None else "bound"
    gone = ""
    if absent:
        reasons = ", ".join(sorted({r.detail for r in absent}))
        gone = f"; {len(absent)} {NOT_IN_VERSION} ({reasons})"
    print(
        f"{len(ok)} of {len(rows) - len(absent)} attach points {verb} for runtime {runtime}; "
        f"{len(not_ok)} not ({', '.join(sorted({r.status for r in not_ok})) or 'none'}){gone}",
        file=out,
    )
    print("next: " + _next_step(not_ok, problem, args.source is not None, bool(absent)), file=out)
    return 0 if fully else 1


def _next_step(
    not_ok: Sequence[Row], problem: str | None, source: bool, absent: bool = False
) -> str:
    if problem:
        return "lower the hang deadline or raise HCCL_EXEC_TIMEOUT, then run doctor again"
    if not not_ok:
        held = " its release holds" if absent else ""
        return (
            f"this tree carries every attach point{held}; deploy it with the guard enabled"
            if source
            else "the guard is fully bound; start vLLM with --additional-config runtime_guard"
        )
    statuses = {r.status for r in not_ok}
    if statuses <= {"not installed"}:
        return "install the missing package, or pass --runtime for the runtime you deploy"
    first = next(r for r in not_ok if r.status not in ("not installed",))
    return (
        f"{first.point.module}.{first.point.qualname}.{first.point.method}: {first.detail}; "
        "the class moved or changed in this version: update ascend_runtime/attach/points.py "
        "(the guard skips it until then; a class removed upstream gets a span there)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if exc.code in (0, None) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
