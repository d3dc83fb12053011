"""deploy/sidecar-requirements.lock: the sidecar image's dependencies, pinned (tools/lock_image.py
writes it; deploy/Containerfile builds with it as pip constraints).

What an unpinned build gets wrong, checked here: a dependency missing from the lock (pip then
takes whatever is newest), a pin below pyproject's floor, a pin that does not meet what another
pinned package requires of it, and a Containerfile that does not use the lock. Requirements are
read from the installed packages' own metadata, for the versions the lock pins."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tools import lock_image

ROOT = Path(__file__).resolve().parents[3]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    assert lock_image.LOCK.exists(), "no deploy/sidecar-requirements.lock"
    return lock_image.read_lock()


def test_every_pin_is_one_exact_version(pins):
    text = lock_image.LOCK.read_text()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", line), line
    assert len(pins) == len([line for line in text.splitlines() if "==" in line])  # no repeats


def test_the_lock_meets_pyprojects_floors_and_holds_every_base_dependency(pins):
    env = lock_image.image_environment()
    for req in lock_image.base_requirements():
        if not lock_image.applies(req, env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject) is not in the lock"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (req, pins[name])


def test_the_lock_is_closed_under_the_pinned_packages_requirements(pins):
    """Every requirement of every pinned package, for the image's platform, is pinned too and
    met by its pin (read from the installed metadata of that same version)."""
    env = lock_image.image_environment()
    checked = 0
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name}=={version} is locked but not installed in the test environment")
        if installed != version:
            continue  # this environment holds another version: its metadata says nothing
        for text in metadata.requires(name) or ():
            child = Requirement(text)
            if not lock_image.applies(child, env):
                continue
            child_name = canonicalize_name(child.name)
            assert child_name in pins, f"{name}=={version} needs {child}, which is not locked"
            assert child.specifier.contains(Version(pins[child_name]), prereleases=True), (
                f"{name}=={version} needs {child}; the lock pins {pins[child_name]}"
            )
            checked += 1
    assert checked >= 5, "too few requirements could be checked against installed metadata"


def test_the_closure_follows_extras_and_markers():
    """The lock's closure: markers evaluated for the image (Linux, its Python), an extra's
    requirements followed only when a requirement asks for that extra."""
    requires = {
        "a": ["b[fast]>=1", 'c; sys_platform == "win32"', 'd; python_version < "3.10"'],
        "b": ['e; extra == "fast"', 'f; extra == "slow"'],
        "e": [],
    }
    got = lock_image.closure(
        [Requirement("a")], version_of=lambda n: "1.0", requires_of=lambda n: requires[n]
    )
    assert got == {"a": "1.0", "b": "1.0", "e": "1.0"}


def test_the_containerfile_builds_with_the_lock():
    text = CONTAINERFILE.read_text()
    lock = "deploy/sidecar-requirements.lock"
    assert f"COPY {lock} " in text
    build = [line for line in text.splitlines() if line.startswith("RUN pip wheel")]
    assert build and f"--constraint {lock}" in build[0], build
    install = [line for line in text.splitlines() if "pip install" in line]
    assert install and all("--no-index" in line for line in install), install
