"""Finds the attach points in a source tree by reading its code, without importing it.

`ascend-guard doctor --source PATH` runs this on a vllm-ascend (or vLLM) checkout, so a
release can be checked on any machine before it is deployed to Ascend hosts. For each attach
point whose package directory is in the tree, the module file is parsed and the class looked up
at module level (nested qualnames by walking class bodies); the method must be defined in the
class body, or, for an inherited point, the class must exist. A point the tree's release cannot
hold (the table's spans: upstream's V1 runner is gone from vLLM 0.34 on) and does not have is
"not in this version", with the reason, not missing.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

from ascend_runtime.attach.points import ATTACH_POINTS, NOT_IN_VERSION, AttachPoint

FOUND = "found"
MISSING = "missing"


@dataclasses.dataclass(frozen=True)
class ScanResult:
    point: AttachPoint
    status: str  # found | missing | not in this version
    detail: str
    file: str = ""
    line: int = 0


class SourceTreeError(ValueError):
    """The path is not a source tree that holds any attach point's package."""


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _find_class(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    body: list[ast.stmt] = tree.body
    found: ast.ClassDef | None = None
    for part in qualname.split("."):
        found = next(
            (n for n in _walk_defs(body) if isinstance(n, ast.ClassDef) and n.name == part), None
        )
        if found is None:
            return None
        body = found.body
    return found


def _walk_defs(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements at this level, including those under if/try (version-dependent definitions)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _walk_defs(node.body)
            yield from _walk_defs(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _walk_defs(block)


def scan_point(root: Path, point: AttachPoint, cache: dict[Path, ast.Module]) -> ScanResult:
    path = module_file(root, point.module)
    if path is None:
        return ScanResult(point, MISSING, f"no module file for {point.module}")
    rel = str(path.relative_to(root))
    tree = cache.get(path)
    if tree is None:
        try:
            tree = cache[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as exc:
            return ScanResult(point, MISSING, f"cannot parse {rel}: {exc}", rel)
    cls = _find_class(tree, point.qualname)
    if cls is None:
        return ScanResult(point, MISSING, f"no class {point.qualname} in {rel}", rel)
    method = next(
        (
            n
            for n in _walk_defs(cls.body)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == point.method
        ),
        None,
    )
    if method is not None:
        return ScanResult(point, FOUND, f"{rel}:{method.lineno}", rel, method.lineno)
    if point.inherited:
        bases = ", ".join(ast.unparse(b) for b in cls.bases) or "object"
        return ScanResult(point, FOUND, f"inherited ({point.qualname}({bases}))", rel, cls.lineno)
    return ScanResult(
        point, MISSING, f"{point.qualname} ({rel}:{cls.lineno}) defines no {point.method}", rel
    )


def packages_in(root: Path) -> list[str]:
    return sorted(
        {p.package for p in ATTACH_POINTS if (root / p.package / "__init__.py").is_file()}
    )


def scan_tree(
    root: str | Path,
    points: Iterable[AttachPoint] = ATTACH_POINTS,
    versions: dict[str, str | None] | None = None,
) -> list[ScanResult]:
    """Scan every attach point whose package is in `root`. `versions` (package -> release)
    defaults to what the tree declares (`tree_version`)."""
    root = Path(root)
    if not root.is_dir():
        raise SourceTreeError(f"--source {root}: not a directory")
    packages = packages_in(root)
    if not packages:
        wanted = sorted({p.package for p in ATTACH_POINTS})
        raise SourceTreeError(
            f"--source {root}: holds none of the packages {', '.join(wanted)} "
            "(give the repository root, the directory that contains vllm_ascend/)"
        )
    if versions is None:
        versions = {package: tree_version(root, package) for package in packages}
    cache: dict[Path, ast.Module] = {}
    return [
        _in_version(scan_point(root, p, cache), versions) for p in points if p.package in packages
    ]


def _in_version(result: ScanResult, versions: dict[str, str | None]) -> ScanResult:
    """A missing point that the tree's release cannot hold becomes "not in this version"."""
    if result.status != MISSING:
        return result
    why = result.point.absent_from(versions)
    if why is None:
        return result
    return ScanResult(result.point, NOT_IN_VERSION, why, result.file, result.line)


_VERSION_RE = re.compile(
    r"""^\s*(?:__version__|version)\s*(?::\s*str)?\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
    re.M,
)


def tree_version(root: str | Path, package: str) -> str | None:
    """The version a source tree declares (a generated _version.py), if any."""
    path = Path(root) / package / "_version.py"
    if path.is_file():
        match = _VERSION_RE.search(path.read_text(encoding="utf-8"))
        if match:
            return match.group(1)
    return None


def tree_info(root: str | Path) -> dict[str, str | None]:
    """Versions and provenance of a checkout: each package's declared version, the git commit
    (when `root` is a git work tree) and, for vllm-ascend, the vLLM release it is verified with
    (`.github/vllm-release-tag.commit`)."""
    root = Path(root)
    info: dict[str, str | None] = {p: tree_version(root, p) for p in packages_in(root)}
    head = root / ".git" / "HEAD"
    if head.is_file():
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref_path = root / ".git" / ref[5:]
            ref = ref_path.read_text().strip() if ref_path.is_file() else ref[5:]
        info["commit"] = ref
    tag = root / ".github" / "vllm-release-tag.commit"
    if tag.is_file():
        info["verified with vllm"] = tag.read_text().strip() or None
    return info
