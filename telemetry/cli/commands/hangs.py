"""`ascend-guard hangs`: hang verdicts, recoveries and watchdog reports, newest first.

From the trace store (what every sidecar on the node recorded), or with `--live` from a running
sidecar's health endpoint (verdicts standing right now; `--sidecar URL` names another sidecar).
`--bundle ID` shows the evidence bundle of one verdict (telemetry/crossrank/bundle.py),
`--bundle` alone lists them.
"""

from __future__ import annotations

import argparse
import json
import sys

from telemetry.cli.args import parse_time_ns
from telemetry.cli.common import (
    LiveFlag,
    add_sidecar_argument,
    add_store_argument,
    clock,
    health_base,
)
from telemetry.cli.http_client import (
    Unreachable,
    add_token_argument,
    get_json,
    refusal_hint,
    token_of,
)
from telemetry.cli.table import render_table
from telemetry.spans.query import QueryError
from telemetry.store import connect
from telemetry.store.incidents import (
    CLOSED_VERDICT,
    EXIT,
    RECOVERY,
    VERDICT,
    IncidentFilter,
    list_incidents,
)
from telemetry.wire import paths

HANG_TYPES = (VERDICT, RECOVERY, CLOSED_VERDICT, EXIT, "hang_suspected")


def add_parser(sub: argparse._SubParsersAction) -> None:
    hangs = sub.add_parser("hangs", help="hang verdicts, recoveries and watchdog reports")
    add_store_argument(hangs)
    hangs.add_argument("--since", default="24h", help="age (15m), unix seconds or ISO time")
    hangs.add_argument("--engine", default=None, help="engine label")
    hangs.add_argument("--run", dest="run_id", default=None, help="run id")
    hangs.add_argument("--limit", type=int, default=50)
    hangs.add_argument(
        "--live",
        action=LiveFlag,
        help="ask the running sidecar for the verdicts standing now, instead of the store "
        "(--sidecar names which; `--live URL` is the old spelling of `--live --sidecar URL`)",
    )
    add_sidecar_argument(hangs, "health")
    hangs.add_argument(
        "--bundle",
        default=None,
        nargs="?",
        const="",
        metavar="ID",
        help="show the evidence bundle of a verdict (its incident names the id); alone: list them",
    )
    hangs.add_argument(
        "--bundle-dir",
        default=paths.cli_bundle_dir(),
        help="bundles folder (default: the local sidecar's from sidecar.json, else "
        f"${paths.STATE_DIR_ENV}/{paths.BUNDLES_NAME})",
    )
    hangs.add_argument("--json", action="store_true", help="one JSON object per line")
    add_token_argument(hangs)


def _rank(r: dict) -> str:
    """tp1/pid1234, with /dev3 where the rank named the device it opened (its npu-smi id)."""
    device = f"/dev{r['device']}" if r.get("device") else ""
    return f"tp{r.get('tp')}/pid{r.get('pid')}{device}"


def _ranks(ranks: list[dict]) -> str:
    return ",".join(_rank(r) for r in ranks) or "-"


def _model(ev: dict) -> str:
    return f"; model {ev['model_name']}" if ev.get("model_name") else ""


def _pods(ev: dict) -> str:
    """The Kubernetes pods of the stopped ranks, where their workers named them."""
    pods = sorted(
        {f"{r.get('namespace', '?')}/{r['pod']}" for r in ev.get("stopped", []) if r.get("pod")}
    )
    return f"; pod {', '.join(pods)}" if pods else ""


def _where(ev: dict) -> str:
    return f"{ev['op']} {ev['group']}#{ev['seq']}" if ev.get("op") else "-"


def _row(time_ns: int, kind: str, ev: dict) -> tuple:
    if kind == VERDICT:
        return (
            clock(time_ns),
            "VERDICT " + ev.get("kind", ""),
            ev.get("engine", ""),
            ev.get("dp", ""),
            _ranks(ev.get("stopped", [])),
            _where(ev),
            _ranks(ev.get("waiting", [])),
            ev.get("wave", ""),
            f"detect {ev.get('detect_s')}s{_model(ev)}{_pods(ev)}",
        )
    if kind in (RECOVERY, CLOSED_VERDICT):  # closed: ended without the ranks moving again
        v = ev.get("verdict", {})
        if kind == RECOVERY:
            label, detail = "recovered", f"stall {ev.get('stall_s')}s"
        else:
            label, detail = "closed", f"after {ev.get('stall_s')}s: {ev.get('why', '')}"
        return (
            clock(time_ns),
            label,
            ev.get("engine", ""),
            ev.get("dp", ""),
            _ranks(v.get("stopped", [])),
            _where(v),
            "-",
            v.get("wave", ""),
            detail,
        )
    if kind == EXIT:
        return (
            clock(time_ns),
            "rank_exited",
            ev.get("engine", ""),
            ev.get("dp", ""),
            _rank(ev),
            "-",
            "-",
            ev.get("last_wave", ""),
            (ev.get("exit") or {}).get("detail", "") + _model(ev),
        )
    return (
        clock(time_ns),
        "watchdog",
        ev.get("engine", ""),
        ev.get("dp", ""),
        f"tp{ev.get('tp')}/pid{ev.get('pid')} waits",
        _where(ev),
        "-",
        ev.get("wave", ""),
        f"age {ev.get('age_s')}s",
    )


HEADER = ("time (UTC)", "event", "engine", "dp", "stopped", "collective", "waiting", "wave", "")


def run(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise QueryError(f"--limit: {args.limit} must be 1 or more")
    if args.bundle is not None:
        return _bundle(args)
    if args.live or args.sidecar:
        return _live(args)
    since = parse_time_ns(args.since, "--since")
    conn = connect(args.store, readonly=True)
    rows = []
    for kind in HANG_TYPES:
        flt = IncidentFilter(
            since_ns=since, type=kind, run_id=args.run_id, engine=args.engine, limit=args.limit
        )
        rows.extend(list_incidents(conn, flt))
    rows.sort(key=lambda r: r["time_ns"], reverse=True)
    rows = rows[: args.limit]
    if args.json:
        for r in rows:
            print(
                json.dumps(
                    {
                        "type": r["type"],
                        "time_ns": r["time_ns"],
                        "engine": r["engine"],
                        "dp": r["dp"],
                        "tp": r["tp"],
                        "pp": r["pp"],
                        "pid": r["pid"],
                        "wave": r["wave"],
                        "summary": r["summary"],
                        "evidence": json.loads(r["evidence"] or "{}"),
                    },
                    sort_keys=True,
                )
            )
        return 0
    if not rows:
        print("no hangs recorded; widen --since")
        return 0
    table = []
    for r in rows:
        ev = json.loads(r["evidence"] or "{}")
        if r["type"] == "hang_suspected":
            ev = {**ev, "engine": r["engine"], "dp": r["dp"], "tp": r["tp"], "pid": r["pid"]}
        table.append(_row(r["time_ns"], r["type"], ev))
    print(render_table(HEADER, table))
    print(f"\n{len(rows)} event(s); details: ascend-guard incidents --type hang_verdict --json")
    for r in rows:
        bundle = json.loads(r["evidence"] or "{}").get("bundle") if r["type"] == VERDICT else None
        if bundle and bundle.get("show"):
            print(f"evidence of the newest verdict: {bundle['show']}")
            break
    return 0


_STREAM_WORDS = {
    "stream_ended": "on this node; its stream ended, its process is still there",
    "found": "on this node; found from its liveness record (no stream to this sidecar)",
    "lost": "not on this node (no liveness record here); its stream was lost, its last state kept",
    "closed": "its worker closed its stream (shutting down)",
    "exited": "its process is gone",
}


def _quiet_line(r: dict) -> str:
    """One rank with no open stream: where it runs, what its stream did, how it is judged."""
    state = {"T": "stopped (T)", "gone": "gone", "": "not readable"}.get(
        r.get("state", ""), f"state {r.get('state')}"
    )
    exit_info = r.get("exit") or {}
    how = f" ({exit_info['detail']})" if exit_info.get("detail") else ""
    process = f"; process {state}" if r.get("where") == "local" else ""
    return (
        f"engine {r['engine']} dp{r['dp']}: tp{r['tp']}/pp{r['pp']} pid {r['pid']} "
        f"[{r['stream']}] {_STREAM_WORDS.get(r['stream'], r['stream'])}{how}{process}; "
        f"silent {r.get('silent_s')}s"
    )


def _live(args: argparse.Namespace) -> int:
    """Exit 3 while a verdict stands, 0 when none does, 2 when the sidecar cannot be asked
    (as `doctor --live`)."""
    base = health_base(args)
    if base is None:
        off = paths.health_off_locally() or {}
        print(
            f"ascend-guard hangs: {paths.health_off_message(off, 'hangs --live')}", file=sys.stderr
        )
        return 2
    url = base + "/hangs"
    try:
        status, body = get_json(url, 5.0, token_of(args))
    except Unreachable as exc:
        print(
            f"ascend-guard hangs: {exc}; is the sidecar running with --health-port?",
            file=sys.stderr,
        )
        return 2
    if status != 200:
        print(f"ascend-guard hangs: {url} answered {status}{refusal_hint(status)}", file=sys.stderr)
        return 2
    standing = [
        v for v in body.get("standing", []) if not args.engine or v["engine"] == args.engine
    ]
    if args.json:
        for v in standing:
            print(json.dumps(v, sort_keys=True))
        return 0
    partial = [p for p in body.get("partial", []) if not args.engine or p["engine"] == args.engine]
    if not standing:
        print("no hang verdict stands on the ranks this sidecar sees")
    else:
        rows = [_row(int(v["verdict_unix"] * 1e9), VERDICT, v) for v in standing]
        print(render_table(HEADER, rows))
        for v in standing:
            if (v.get("bundle") or {}).get("show"):
                print(f"evidence, engine {v['engine']} dp{v['dp']}: {v['bundle']['show']}")
    for r in body.get("without_stream", []):
        if not args.engine or r["engine"] == args.engine:
            print(_quiet_line(r))
    for p in partial:  # ranks on other nodes: no local verdict covers them (docs/cross-node.md)
        ranks = ", ".join(f"tp{r['tp']}/pp{r['pp']}" for r in p["not_seen"])
        print(
            f"engine {p['engine']} dp{p['dp']}: {ranks} not seen by this sidecar (other nodes); "
            "the cluster alerts judge them (AscendGuardClusterRankSilent, ...NotArrived)"
        )
    return 3 if standing else 0  # like a failed probe: an engine is wedged


# -- evidence bundles -------------------------------------------------------------------------
def _bundle(args: argparse.Namespace) -> int:
    from telemetry.crossrank.bundle import list_bundles, read_bundle

    if not args.bundle:
        ids = list_bundles(args.bundle_dir)
        if not ids:
            print(f"no evidence bundles in {args.bundle_dir}")
            return 0
        rows = []
        for bundle_id in ids[: args.limit]:
            try:
                verdict = read_bundle(args.bundle_dir, bundle_id).get("verdict", {})
            except (OSError, ValueError):
                verdict = {}
            rows.append((bundle_id, verdict.get("kind", "?"), verdict.get("summary", "")))
        print(render_table(("bundle", "kind", "verdict"), rows))
        print("\nshow one: ascend-guard hangs --bundle ID")
        return 0
    try:
        bundle = read_bundle(args.bundle_dir, args.bundle)
    except ValueError as exc:
        print(f"ascend-guard hangs: {exc}")
        return 2
    except FileNotFoundError:
        print(
            f"ascend-guard hangs: no bundle {args.bundle} in {args.bundle_dir} (removed by "
            "rotation, another node's, or another --bundle-dir); list: ascend-guard hangs --bundle"
        )
        return 1
    if args.json:
        print(json.dumps(bundle, sort_keys=True))
        return 0
    print(render_bundle(bundle))
    return 0


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def render_bundle(bundle: dict) -> str:
    """A bundle for people: a heading, then one section per rank."""
    verdict = bundle.get("verdict", {})
    created = bundle.get("created_unix", 0.0)
    lines = [
        f"bundle {bundle.get('id')}  node {bundle.get('node')}  "
        f"written {clock(int(created * 1e9))} UTC",
        f"verdict {verdict.get('summary', '?')}",
        f"        onset {clock(int(verdict.get('onset_unix', 0) * 1e9))} UTC, "
        f"verdict {clock(int(verdict.get('verdict_unix', 0) * 1e9))} UTC",
    ]
    if bundle.get("cut"):
        lines.append("cut to fit its size: " + ", ".join(bundle["cut"]))
    for rank in bundle.get("ranks", []):
        lines += ["", _rank_heading(rank), *_rank_sections(rank, created)]
    return "\n".join(lines)


def _rank_heading(rank: dict) -> str:
    return (
        f"== dp{rank.get('dp')} tp{rank.get('tp')} pp{rank.get('pp')}  pid {rank.get('pid')}  "
        f"{rank.get('role', '').upper()}  node {rank.get('node')}"
    )


def _rank_sections(rank: dict, created: float) -> list[str]:
    proc = rank.get("process", {})
    out = [
        f"process      state {proc.get('state', '?')}  wchan {proc.get('wchan', '-')}"
        + (f"  ({proc['note']})" if proc.get("note") else "")
    ]
    if proc.get("kernel_stack"):
        out.append("kernel stack " + proc["kernel_stack"][0])
        out += ["             " + line for line in proc["kernel_stack"][1:]]
    elif proc.get("kernel_stack_note"):
        out.append(f"kernel stack {proc['kernel_stack_note']}")
    coll = rank.get("collectives", {})
    entries = coll.get("entries", [])
    if entries:
        out.append(f"collectives  the last {len(entries)}, oldest first")
        rows = []
        for e in entries:
            start = e.get("start_unix", 0.0)
            end = e.get("end_unix")
            if isinstance(end, (int, float)):
                took = _ms(end - start)
            else:
                took = f"NOT RETURNED ({_ms(max(0.0, created - start))} at writing)"
            row = (e.get("call"), e.get("op"), e.get("group"), e.get("seq"), e.get("bytes"))
            rows.append((*row, clock(int(start * 1e9)), took))
        table = render_table(
            ("call", "op", "group", "seq", "bytes", "start (UTC)", "took"), rows, right=(0, 3, 4)
        )
        out += ["  " + line for line in table.splitlines()]
    else:
        out.append(f"collectives  none: {coll.get('note', '')}")
    stack = rank.get("stack", {})
    if stack.get("answered"):
        threads = stack.get("threads", [])
        out.append(
            f"python stack answered in {stack.get('answer_s')} s, {len(threads)} thread(s)"
            + (f" shown, {stack['threads_cut']} cut" if stack.get("threads_cut") else "")
        )
        for thread in threads:
            tag = "engine thread" if thread.get("engine") else "thread"
            out.append(f"  {tag} {thread.get('thread')} (most recent call first)")
            out += ["    " + frame for frame in thread.get("frames", [])]
    else:
        out.append(f"python stack none: {stack.get('note', '')}")
    fr = rank.get("flight_recorder", {})
    if fr.get("triggered"):
        size = fr.get("dump_bytes")
        out.append(
            f"flight rec.  triggered via {fr.get('pipe')}; dump {fr.get('dump')} "
            + (f"({size} bytes)" if size is not None else "(not written yet)")
        )
    elif fr.get("available"):
        out.append(f"flight rec.  not triggered: {fr.get('note', '')}")
    else:
        out.append(f"flight rec.  not available: {fr.get('note', '')}")
    return out
