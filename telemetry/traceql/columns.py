"""Field expressions evaluated over a table of spans at once, and planned before any span exists.

A table answers `column(field) -> (values, present)`, where values and present are numpy arrays
or scalars (one value for every row: a block's rank coordinates, a span name). The same
evaluator runs over the columns of a stored wave block (no span built) and over the spans of a
loaded trace, so a block's pre-filter and the final check cannot disagree.

`maybe()` evaluates an expression with only some fields known (a rank's coordinates, a span
kind's attribute keys), in three-valued logic: False means no span there can match, so the
planner skips that rank, kind or block.
"""

from __future__ import annotations

import math
import operator
from typing import Protocol

import numpy as np

from telemetry.traceql import ast

_NUMPY_OPS = {
    "=": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_FLIP = {"=": "=", "!=": "!=", ">": "<", ">=": "<=", "<": ">", "<=": ">="}


class Coded:
    """A column of few distinct values (op, group, span name...): the values once, and a code
    per row. Comparisons run once per distinct value."""

    def __init__(self, values: list) -> None:
        index: dict = {}
        self.codes = np.fromiter(
            (index.setdefault(v, len(index)) for v in values), np.int64, len(values)
        )
        self.levels = list(index)

    @classmethod
    def relabel(cls, other: Coded, levels: list) -> Coded:
        """The same rows with each distinct value replaced (levels in `other`'s order)."""
        out = cls([])
        out.codes, out.levels = other.codes, list(levels)
        return out

    def decode(self) -> np.ndarray:
        levels = np.empty(len(self.levels), object)
        levels[:] = self.levels
        return levels[self.codes]


class Table(Protocol):
    n: int

    def column(self, field: ast.Field) -> tuple[object, object]: ...


def _category(value) -> str | None:
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return "num"
    if isinstance(value, str):
        return "str"
    return None


def static_category(static: ast.Static) -> str | None:
    if static.type in ("int", "float", "duration"):
        return "num"
    if static.type in ("string", "status", "kind"):
        return "str"
    if static.type == "bool":
        return "bool"
    return None


def scalar_cmp(op: str, left, right, pattern) -> bool:
    """One comparison; values of different types never match (as in Tempo)."""
    if pattern is not None:
        if not isinstance(left, str):
            return False
        hit = pattern.fullmatch(left) is not None  # TraceQL regexes are fully anchored
        return hit if op == "=~" else not hit
    if _category(left) != _category(right) or _category(left) is None:
        return False
    return bool(_NUMPY_OPS[op](left, right))


def _array_category(values: np.ndarray) -> str | None:
    if values.dtype == bool:
        return "bool"
    if values.dtype.kind in "iuf":
        return "num"
    return None  # object: decided per element


def compare(op: str, values, present, static: ast.Static, pattern=None):
    """A column against a static: a bool array (or a bool scalar for a constant column)."""
    if static.type == "nil":
        if op == "=":
            return np.logical_not(present)
        if op == "!=":
            return present
        return False
    right = static.value
    if isinstance(values, Coded):
        hits = np.fromiter(
            (scalar_cmp(op, v, right, pattern) for v in values.levels), bool, len(values.levels)
        )
        return hits[values.codes] & present
    if isinstance(values, np.ndarray) and values.dtype != object and _fits_numpy_compare(right):
        if pattern is not None or _array_category(values) != static_category(static):
            return False
        return _NUMPY_OPS[op](values, right) & present
    if not isinstance(values, np.ndarray):
        return bool(present) and scalar_cmp(op, values, right, pattern)
    present = np.broadcast_to(present, values.shape)
    return np.fromiter(
        (p and scalar_cmp(op, v, right, pattern) for v, p in zip(values, present, strict=False)),
        bool,
        len(values),
    )


def _fits_numpy_compare(value) -> bool:
    """Whether numpy compares an array with this static exactly (not an int past 64 bits)."""
    return not isinstance(value, int) or isinstance(value, bool) or -(2**63) <= value < 2**63


def _as_objects(values, n: int) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(object) if values.dtype != object else values
    out = np.empty(n, object)
    out[:] = [values] * n
    return out


_TRUE = ast.Static(True, "bool", "true")
_FALSE = ast.Static(False, "bool", "false")
_VALUES = (ast.Intrinsic, ast.Attribute, ast.Arithmetic, ast.Negate)


def evaluate(expr: ast.FieldExpr, table: Table):
    """A boolean expression -> a bool array over the table's rows (or a bool scalar)."""
    if isinstance(expr, ast.Static):
        return bool(expr.value) if expr.type == "bool" else False
    if isinstance(expr, _VALUES):
        # a value used as a condition (`{ .a }`) holds where it is the boolean true
        values, present = raw_value_of(expr, table)
        return compare("=", values, present, _TRUE)
    if isinstance(expr, ast.Logical):
        left = evaluate(expr.left, table)
        right = evaluate(expr.right, table)
        return (left & right) if expr.op == "&&" else (left | right)
    if isinstance(expr, ast.Not):
        if isinstance(expr.operand, _VALUES):  # `!.a` holds where .a is the boolean false
            values, present = raw_value_of(expr.operand, table)
            return compare("=", values, present, _FALSE)
        return np.logical_not(evaluate(expr.operand, table))
    if isinstance(expr, ast.Comparison):
        left, right, op = expr.left, expr.right, expr.op
        if isinstance(left, ast.Static) and not isinstance(right, ast.Static) and op in _FLIP:
            left, right, op = right, left, _FLIP[op]
        if isinstance(right, ast.Static):
            if isinstance(left, ast.Static):  # two statics: a constant
                return scalar_cmp(op, left.value, right.value, expr.pattern)
            values, present = raw_value_of(left, table)
            return compare(op, values, present, right, expr.pattern)
        lv, lp = value_of(left, table)
        rv, rp = value_of(right, table)
        n = table.n
        lv, rv = _as_objects(lv, n), _as_objects(rv, n)
        both = np.broadcast_to(lp, (n,)) & np.broadcast_to(rp, (n,))
        return np.fromiter(
            (b and scalar_cmp(op, a, c, None) for a, c, b in zip(lv, rv, both, strict=False)),
            bool,
            n,
        )
    raise TypeError(f"not a boolean expression: {expr}")


def raw_value_of(expr: ast.FieldExpr, table: Table):
    """(values, present) of a field (or a static) over the table; values may be `Coded`."""
    if isinstance(expr, ast.Static):
        return expr.value, expr.type != "nil"
    if isinstance(expr, (ast.Intrinsic, ast.Attribute)):
        return table.column(expr)
    if isinstance(expr, ast.Arithmetic | ast.Negate):
        return _arithmetic(expr, table)
    mask = evaluate(expr, table)
    return mask, True


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _trunc_div(a: int, b: int) -> int:
    """Integer division rounding toward zero, as Tempo's (Go's) does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def arithmetic_scalar(op: str, a, b):
    """One arithmetic operation; None (nil) where an operand is not a number, a division is by
    zero or the result does not fit a float."""
    if not (_number(a) and _number(b)):
        return None
    a = a.item() if isinstance(a, np.generic) else a
    b = b.item() if isinstance(b, np.generic) else b
    both_int = isinstance(a, int) and isinstance(b, int)
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            if b == 0:
                return None
            return _trunc_div(a, b) if both_int else a / b
        if op == "%":
            if b == 0:
                return None
            return a - b * _trunc_div(a, b) if both_int else math.fmod(a, b)
        if op == "^":
            if both_int and 0 <= b <= 64:
                return a**b
            result = math.pow(a, b)
            return result if math.isfinite(result) else None
    except (OverflowError, ValueError, ZeroDivisionError):
        return None
    raise ValueError(f"not an arithmetic operator: {op}")


def _fits_numpy(values) -> bool:
    if isinstance(values, np.ndarray):
        return values.dtype.kind in "if"
    if isinstance(values, float | np.floating):
        return True
    return isinstance(values, int | np.integer) and abs(int(values)) < 2**53


def _arithmetic(expr, table: Table):
    """(values, present) of `a + b`, `-a`, ...: numbers where both operands are numbers."""
    if isinstance(expr, ast.Negate):
        values, present = value_of(expr.operand, table)
        left, lp, op, right, rp = 0, True, "-", values, present
    else:
        left, lp = value_of(expr.left, table)
        right, rp = value_of(expr.right, table)
        op = expr.op
    arrays = isinstance(left, np.ndarray) or isinstance(right, np.ndarray)
    if arrays and op in "+-*" and _fits_numpy(left) and _fits_numpy(right):
        with np.errstate(all="ignore"):
            out = _ARITH_NUMPY[op](np.asarray(left), np.asarray(right))
        return out, np.broadcast_to(np.asarray(lp) & np.asarray(rp), np.shape(out))
    if not arrays:
        result = arithmetic_scalar(op, left, right) if (bool(lp) and bool(rp)) else None
        return result, result is not None
    n = table.n
    lv, rv = _as_objects(left, n), _as_objects(right, n)
    both = np.broadcast_to(lp, (n,)) & np.broadcast_to(rp, (n,))
    out = np.empty(n, object)
    out[:] = [
        arithmetic_scalar(op, a, b) if p else None for a, b, p in zip(lv, rv, both, strict=True)
    ]
    present = np.fromiter((v is not None for v in out), bool, n)
    return out, present


_ARITH_NUMPY = {"+": np.add, "-": np.subtract, "*": np.multiply}


def value_of(expr: ast.FieldExpr, table: Table):
    """(values, present) of a field (or a static) over the table: arrays or scalars."""
    values, present = raw_value_of(expr, table)
    return (values.decode() if isinstance(values, Coded) else values), present


def mask_of(expr: ast.FieldExpr | None, table: Table) -> np.ndarray:
    """The rows the filter keeps, as a bool array of the table's length."""
    if expr is None:
        return np.ones(table.n, bool)
    return np.broadcast_to(np.asarray(evaluate(expr, table), bool), (table.n,))


# -- planning: three-valued evaluation with some fields known ---------------------------------
UNKNOWN = object()  # a field whose value the planner does not know
ABSENT = object()  # a field no span of the profile carries


class Prefixed(str):
    """A string value known only by its start (a collective span's name: `collective:<op>`)."""


def maybe(expr: ast.FieldExpr, known) -> bool | None:
    """True / False / None (cannot tell) for an expression, given `known(field)`: a value,
    ABSENT or UNKNOWN."""
    if isinstance(expr, ast.Static):
        return bool(expr.value) if expr.type == "bool" else False
    if isinstance(expr, ast.Intrinsic | ast.Attribute):
        value = known(expr)
        if value is UNKNOWN:
            return None
        return value is True
    if isinstance(expr, _VALUES):
        return None
    if isinstance(expr, ast.Logical):
        left, right = maybe(expr.left, known), maybe(expr.right, known)
        if expr.op == "&&":
            if left is False or right is False:
                return False
            return True if left is True and right is True else None
        if left is True or right is True:
            return True
        return False if left is False and right is False else None
    if isinstance(expr, ast.Not):
        if isinstance(expr.operand, ast.Intrinsic | ast.Attribute):
            value = known(expr.operand)
            return None if value is UNKNOWN else value is False
        if isinstance(expr.operand, _VALUES):
            return None
        inner = maybe(expr.operand, known)
        return None if inner is None else not inner
    if isinstance(expr, ast.Comparison):
        left, right, op = expr.left, expr.right, expr.op
        if isinstance(left, ast.Static) and not isinstance(right, ast.Static):
            if op not in _FLIP:
                return None
            left, right, op = right, left, _FLIP[op]
        if not isinstance(right, ast.Static) or not isinstance(left, ast.Intrinsic | ast.Attribute):
            return None
        value = known(left)
        if value is UNKNOWN:
            return None
        if value is ABSENT:
            return right.type == "nil" and op == "="
        if right.type == "nil":
            return op == "!="
        if isinstance(value, Prefixed):
            ruled_out = isinstance(right.value, str) and not right.value.startswith(value)
            return (op == "!=") if op in ("=", "!=") and ruled_out else None
        return scalar_cmp(op, value, right.value, expr.pattern)
    return None


def lower_bounds(expr: ast.FieldExpr | None, field: ast.Field) -> int | None:
    """The least value `field` must have for the filter to hold (from `field > X` / `>= X`
    conjuncts), or None: the planner prunes wave blocks by their slowest step with it."""
    if expr is None:
        return None
    if isinstance(expr, ast.Logical):
        left, right = lower_bounds(expr.left, field), lower_bounds(expr.right, field)
        if expr.op == "&&":
            bounds = [b for b in (left, right) if b is not None]
            return max(bounds) if bounds else None
        return min(left, right) if left is not None and right is not None else None
    if isinstance(expr, ast.Comparison) and expr.left == field:
        right = expr.right
        numeric = isinstance(right, ast.Static) and static_category(right) == "num"
        if numeric and expr.op in (">", ">=", "="):
            return int(right.value)
    return None
