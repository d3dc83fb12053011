"""The command line of the repository's generators: write what they render, or with `--check`
name the files that drifted and exit 1 (what the drift tests and `make` targets run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(
    argv: Sequence[str] | None,
    description: str,
    render: Callable[[], Mapping[Path, str]],
    drifted: str,
) -> int:
    """Write each rendered file that differs (or is missing); with --check write nothing, and
    print `drifted` (a template with {names}) when any differs. Returns the exit status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on drift")
    args = parser.parse_args(argv)
    texts = render()
    stale = [
        path for path, text in texts.items() if not (path.exists() and path.read_text() == text)
    ]
    if not args.check:
        for path in stale:
            path.write_text(texts[path])
        return 0
    if stale:
        names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
        print(drifted.format(names=names), file=sys.stderr)
        return 1
    return 0
