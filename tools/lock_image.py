"""The sidecar image's dependency lock: deploy/sidecar-requirements.lock.

    python tools/lock_image.py          # write the lock from this environment
    python tools/lock_image.py --check  # exit 1 when this environment's versions differ

The image (deploy/Containerfile) installs ascend-guard's base dependencies only (no torch, no
vLLM). pyproject.toml gives them as floors, so two builds a month apart install different
versions; the Containerfile builds with the lock as pip constraints, so every build installs
the versions written here: those of the environment the test suite ran on when the lock was
written (the versions this project tested). The lock holds the whole closure (dependencies of
dependencies) for the image's platform, Linux with the image's Python, one `name==version` per
line. It pins versions, not hashes: the hashes differ per platform wheel (x86_64, aarch64) and
this repository has no registry to read them from; a build that needs hash checking adds them
with its own mirror (`pip hash`, or `pip-compile --generate-hashes` against it).
tests/unit/deploy/test_image_lock.py checks the lock is whole and meets pyproject's floors.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib  # novermin - a maintainer's tool, run where the lock is made (3.11+)
except ModuleNotFoundError:  # Python 3.10
    raise SystemExit("tools/lock_image.py needs Python 3.11 or newer (tomllib)") from None
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "deploy" / "sidecar-requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
IMAGE_PYTHON = "3.11"  # deploy/Containerfile's PYTHON_IMAGE (python:3.11-slim)
HEADER = """\
# The sidecar image's dependencies, pinned: pip constraints for deploy/Containerfile.
# Written by tools/lock_image.py from the environment the test suite ran on; do not edit.
# Versions only (no hashes): see tools/lock_image.py.
"""


def image_environment() -> dict[str, str]:
    """The marker environment of the image: Linux, CPython IMAGE_PYTHON, no extras."""
    env = default_environment()
    env.update(
        python_version=IMAGE_PYTHON,
        python_full_version=f"{IMAGE_PYTHON}.0",
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        extra="",
    )
    return env


def base_requirements() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return [Requirement(text) for text in project["dependencies"]]


def applies(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def closure(
    roots: list[Requirement], version_of=metadata.version, requires_of=metadata.requires
) -> dict[str, str]:
    """canonical name -> version of every package the roots need on the image (what is
    installed here), following each installed package's own requirements."""
    env = image_environment()
    found: dict[str, str] = {}
    todo = [r for r in roots if applies(r, env)]
    done: set[tuple[str, str]] = set()  # (package, extra) already followed
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        found.setdefault(name, version_of(req.name))
        for extra in ("", *sorted(req.extras)):  # an extra asked for adds its requirements
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for text in requires_of(req.name) or ():
                child = Requirement(text)
                if applies(child, {**env, "extra": extra}):
                    todo.append(child)
    return dict(sorted(found.items()))


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in pins.items())


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path}: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/lock_image.py")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render(closure(base_requirements()))
    if args.check:
        if LOCK.exists() and LOCK.read_text() == text:
            return 0
        print(f"{LOCK} differs from this environment; run python tools/lock_image.py")
        return 1
    LOCK.write_text(text)
    print(f"wrote {LOCK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
