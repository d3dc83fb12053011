"""TraceQL text -> the typed tree of telemetry/traceql/ast.py, with lark (LALR).

Grammar facts follow Tempo's TraceQL (docs/traceql.md lists the subset): `&&` and `||` share
one precedence level and associate left, both inside `{ }` and between spansets; structural
operators bind tighter than them. Every error is a `TraceQLParseError` naming the line, the
column and the offending token.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from decimal import Decimal

import lark

from telemetry.traceql import ast
from telemetry.traceql.errors import TraceQLError
from telemetry.traceql.validate import validate

_GRAMMAR = r"""
start: pipeline hints?

pipeline: first_stage pipe_item*
?first_stage: spanset_expr
            | scalar_filter
            | group_by
            | select

pipe_item: "|" stage

?stage: spanset_expr
      | scalar_filter
      | group_by
      | select
      | COALESCE "(" ")"                                -> coalesce
      | metrics

group_by: BY "(" field_expr ("," field_expr)* ")"
select: SELECT "(" field ("," field)* ")"

scalar_filter: aggregate scalar_op signed_static
             | signed_static scalar_op aggregate        -> scalar_filter_flipped

aggregate: COUNT "(" ")"
         | AGG_FN "(" field_expr ")"

metrics: METRICS_FN "(" metrics_args? ")" (BY "(" field ("," field)* ")")?
metrics_args: field ("," signed_static)*

hints: WITH "(" hint ("," hint)* ")"
hint: IDENT "=" signed_static

?spanset_expr: spanset_struct
             | spanset_expr SS_LOGIC spanset_struct        -> spanset_op

?spanset_struct: spanset_atom
               | spanset_struct struct_op spanset_atom    -> spanset_op

?spanset_atom: "{" field_expr? "}"                       -> spanset_filter
             | "(" pipeline ")"                         -> wrapped

!struct_op: ">>" | ">" | "<<" | "<" | "~" | "!>>" | "!>" | "!<<" | "!<" | "!~"
          | "&>>" | "&>" | "&<<" | "&<" | "&~"
!cmp_op: "=" | "!=" | ">" | ">=" | "<" | "<=" | "=~" | "!~"
!scalar_op: "=" | "!=" | ">" | ">=" | "<" | "<=" | "=~" | "!~"
SS_LOGIC: "&&" | "||"

?field_expr: field_cmp
           | field_expr SS_LOGIC field_cmp              -> logical

?field_cmp: field_sum
          | field_cmp cmp_op field_sum                  -> comparison

?field_sum: field_mul
          | field_sum (PLUS | MINUS) field_mul          -> arithmetic

?field_mul: field_unary
          | field_mul (STAR | SLASH | PERCENT) field_unary -> arithmetic

?field_unary: field_pow
            | "!" field_unary                           -> not_
            | MINUS field_unary                         -> negate

?field_pow: field_atom
          | field_atom CARET field_unary                -> arithmetic

?field_atom: static
           | field
           | "(" field_expr ")"

PLUS: "+"
MINUS: "-"
STAR: "*"
SLASH: "/"
PERCENT: "%"
CARET: "^"

field: INTRINSIC | SCOPED_INTRINSIC | SCOPED_ATTR | UNSCOPED_ATTR | IDENT

?signed_static: static
              | MINUS signed_static                     -> negate_static

static: STRING | DURATION | FLOAT | INT | TRUE | FALSE | NIL | STATUS | KIND

{keywords}
SCOPED_INTRINSIC.4: /(span|trace|event|link|instrumentation):[A-Za-z]+/
SCOPED_ATTR.4: /(span|resource|event|link|instrumentation)\.[A-Za-z0-9_][A-Za-z0-9_.\-\/]*/
UNSCOPED_ATTR.4: /\.[A-Za-z_][A-Za-z0-9_.\-\/]*/
DURATION.3: /(\d+(\.\d+)?(ns|us|µs|ms|s|m|h|d))+(?![A-Za-z0-9_])/
FLOAT.2: /(\d+\.\d*|\.\d+)([eE][-+]?\d+)?|\d+[eE][-+]?\d+/
INT.1: /\d+/
IDENT: /[A-Za-z_][A-Za-z0-9_]*/
STRING: /"(\\.|[^"\\\n])*"/ | /`[^`]*`/

%import common.WS
%ignore WS
"""


def _keyword(words) -> str:
    """A terminal pattern for whole words only (ahead of IDENT: `names` is not `name`)."""
    return "/(" + "|".join(sorted(words, key=len, reverse=True)) + ")(?![A-Za-z0-9_])/"


# keywords come from the AST's own tables, so grammar and evaluator name the same things
_KEYWORDS = {
    "COUNT": ["count"],
    "AGG_FN": [a for a in ast.AGGREGATES if a != "count"],
    "METRICS_FN": list(ast.METRICS_FUNCTIONS),
    "BY": ["by"],
    "SELECT": ["select"],
    "COALESCE": ["coalesce"],
    "WITH": ["with"],
    "TRUE": ["true"],
    "FALSE": ["false"],
    "NIL": ["nil"],
    "STATUS": list(ast.STATUS_VALUES),
    "KIND": list(ast.KIND_VALUES),
    "INTRINSIC": list(ast.INTRINSICS),
}
GRAMMAR = _GRAMMAR.replace(
    "{keywords}", "\n".join(f"{name}.2: {_keyword(words)}" for name, words in _KEYWORDS.items())
)

MAX_QUERY_CHARS = 16 * 1024
MAX_DEPTH = 128  # AST levels: the evaluator and printer recurse this deep

_UNIT_NS = {
    "ns": 1,
    "us": 10**3,
    "µs": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
    "d": 86400 * 10**9,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d)")
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


class TraceQLParseError(TraceQLError):
    """A query that is not in the supported TraceQL subset.

    `line` and `column` are 1-based, `offset` 0-based; `token` is the offending text ("" at the
    end of the query)."""

    def __init__(self, message: str, *, line: int, column: int, offset: int, token: str):
        where = f"line {line}, column {column}"
        shown = repr(token) if token else "end of query"
        super().__init__(f"TraceQL: {message} at {where} ({shown})")
        self.reason = message
        self.line, self.column, self.offset, self.token = line, column, offset, token


def _error_at(token: lark.Token, message: str) -> TraceQLParseError:
    return TraceQLParseError(
        message,
        line=token.line or 1,
        column=token.column or 1,
        offset=token.start_pos or 0,
        token=str(token),
    )


def parse_duration(text: str) -> int:
    """'50ms', '1.5s', '1h30m', '-5s' -> integer nanoseconds (exact decimal arithmetic)."""
    sign = -1 if text.startswith("-") else 1
    total = Decimal(0)
    for number, unit in _DURATION_PART.findall(text):
        total += Decimal(number) * _UNIT_NS[unit]
    return sign * int(total)


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    body, out, i = text[1:-1], [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(_ESCAPES.get(body[i + 1], "\\" + body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


class _ToAst(lark.visitors.Transformer_NonRecursive):
    """Parse tree -> ast nodes; checks that lark's grammar leaves to the tree (types, regexes)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self._text = text
        self._where: dict[int, lark.Token] = {}  # id(metrics node) -> its function token

    def static(self, children):
        (tok,) = children
        text = str(tok)
        kind = tok.type
        if kind == "STRING":
            return ast.Static(_unquote(text), "string", text)
        if kind == "DURATION":
            return ast.Static(parse_duration(text), "duration", text)
        if kind == "FLOAT":
            return ast.Static(float(text), "float", text)
        if kind == "INT":
            return ast.Static(int(text), "int", text)
        if kind in ("TRUE", "FALSE"):
            return ast.Static(kind == "TRUE", "bool", text)
        if kind == "NIL":
            return ast.Static(None, "nil", text)
        if kind == "STATUS":
            return ast.Static(text, "status", text)
        return ast.Static(text, "kind", text)  # KIND

    def negate_static(self, children):
        minus, value = children
        if value.type not in ("int", "float", "duration"):
            raise _error_at(minus, f"- needs a number or a duration, not {value.text}")
        return ast.Static(-value.value, value.type, "-" + value.text)

    def field(self, children):
        (tok,) = children
        text = str(tok)
        if tok.type == "INTRINSIC":
            return ast.Intrinsic(text)
        if tok.type == "SCOPED_INTRINSIC":
            if text not in ast.SCOPED_INTRINSICS:
                raise _error_at(
                    tok,
                    f"unknown scoped intrinsic; one of {', '.join(ast.SCOPED_INTRINSICS)}",
                )
            return ast.Intrinsic(ast.SCOPED_INTRINSICS[text])
        if tok.type == "SCOPED_ATTR":
            scope, _, name = text.partition(".")
            return ast.Attribute(name, scope)
        if tok.type == "UNSCOPED_ATTR":
            return ast.Attribute(text[1:], None)
        raise _error_at(
            tok, f"unknown identifier; an attribute needs a scope (.{text} or span.{text})"
        )

    def not_(self, children):
        (operand,) = children
        return ast.Not(operand)

    def negate(self, children):
        _, operand = children
        if isinstance(operand, ast.Static) and operand.type in ("int", "float", "duration"):
            return ast.Static(-operand.value, operand.type, "-" + operand.text)
        return ast.Negate(operand)

    def arithmetic(self, children):
        left, op, right = children
        return ast.Arithmetic(str(op), left, right)

    def comparison(self, children):
        left, op_tree, right = children
        op_tok = op_tree.children[0]
        op = str(op_tok)
        pattern = None
        if op in ("=~", "!~"):
            if not (isinstance(right, ast.Static) and right.type == "string"):
                raise _error_at(op_tok, f"{op} needs a string regular expression on its right")
            try:
                pattern = re.compile(right.value)
            except (re.error, RecursionError, OverflowError) as exc:
                raise _error_at(op_tok, f"bad regular expression {right.text}: {exc}") from None
        return ast.Comparison(op, left, right, pattern)

    def logical(self, children):
        left, op, right = children
        return ast.Logical(str(op), left, right)

    def spanset_filter(self, children):
        if not children:
            return ast.SpansetFilter(None)
        (expr,) = children
        return ast.SpansetFilter(expr)

    def spanset_op(self, children):
        left, op, right = children
        op_text = str(op.children[0]) if isinstance(op, lark.Tree) else str(op)
        return ast.SpansetOp(op_text, left, right)

    def aggregate(self, children):
        if len(children) == 1:
            return ast.Aggregate("count", None)
        fn, field = children
        return ast.Aggregate(str(fn), field)

    def scalar_filter(self, children):
        aggregate, op_tree, value = children
        op_tok = op_tree.children[0]
        if str(op_tok) in ("=~", "!~"):
            raise _error_at(op_tok, "an aggregate compares with = != > >= < <=, not a regex")
        if value.type not in ("int", "float", "duration"):
            raise _error_at(op_tok, f"an aggregate compares with a number, not {value.text}")
        return ast.ScalarFilter(aggregate, str(op_tok), value)

    def scalar_filter_flipped(self, children):
        value, op_tree, aggregate = children
        op_tok = op_tree.children[0]
        flipped = {">": "<", ">=": "<=", "<": ">", "<=": ">="}.get(str(op_tok), str(op_tok))
        tok = lark.Token(op_tok.type, flipped, op_tok.start_pos, op_tok.line, op_tok.column)
        return self.scalar_filter([aggregate, lark.Tree("scalar_op", [tok]), value])

    def group_by(self, children):
        return ast.GroupBy(tuple(children[1:]))

    def select(self, children):
        return ast.Select(tuple(children[1:]))

    def coalesce(self, children):
        return ast.Coalesce()

    def metrics_args(self, children):
        return children

    def metrics(self, children):
        fn_tok, rest = children[0], children[1:]
        fn = str(fn_tok)
        args = []
        if rest and isinstance(rest[0], list):
            args = rest[0]
            rest = rest[1:]
        by = tuple(c for c in rest if not isinstance(c, lark.Token))
        field, statics = (args[0], args[1:]) if args else (None, [])
        if fn in ("rate", "count_over_time"):
            if args:
                raise _error_at(fn_tok, f"{fn}() takes no arguments")
        elif fn == "quantile_over_time":
            if field is None or not statics:
                raise _error_at(fn_tok, "quantile_over_time needs a value and quantiles")
            for q in statics:
                if q.type not in ("int", "float") or not 0 <= float(q.value) <= 1:
                    raise _error_at(fn_tok, f"quantile {q.text} is not a number in [0, 1]")
        else:
            if field is None or statics:
                raise _error_at(fn_tok, f"{fn} takes one value, e.g. {fn}(duration)")
        quantiles = tuple(float(q.value) for q in statics)
        node = ast.MetricsAggregate(fn, field, quantiles, by)
        self._where[id(node)] = fn_tok
        return node

    def hint(self, children):
        name, value = children
        return (str(name), value)

    def hints(self, children):
        return tuple(children[1:])

    def pipe_item(self, children):
        (stage,) = children
        return stage

    def pipeline(self, children) -> _Pipeline:
        first, stages = children[0], list(children[1:])
        if not isinstance(first, ast.SpansetFilter | ast.SpansetOp | ast.SubPipeline):
            # a pipeline that starts with a scalar filter, by() or select() reads every span
            stages.insert(0, first)
            first = ast.SpansetFilter(None)
        metrics = None
        for i, stage in enumerate(stages):
            if isinstance(stage, ast.MetricsAggregate):
                if i != len(stages) - 1:
                    raise _error_at(self._where[id(stage)], f"{stage.fn}() must be the last stage")
                metrics = stage
        if metrics is not None:
            stages.pop()
        return _Pipeline(first, tuple(stages), metrics)

    def wrapped(self, children):
        (pipeline,) = children
        if pipeline.metrics is not None:
            raise _error_at(
                self._where[id(pipeline.metrics)],
                f"{pipeline.metrics.fn}() must be the last stage of the whole query",
            )
        if not pipeline.stages:
            return pipeline.spanset
        return ast.SubPipeline(pipeline.spanset, pipeline.stages)

    def start(self, children):
        pipeline, rest = children[0], children[1:]
        hints = rest[0] if rest else ()
        return ast.Query(pipeline.spanset, pipeline.stages, pipeline.metrics, hints)


@dataclasses.dataclass
class _Pipeline:
    spanset: ast.SpansetExpr
    stages: tuple
    metrics: ast.MetricsAggregate | None


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(GRAMMAR, parser="lalr", lexer="contextual", propagate_positions=True)


# how an error message names what lark expected
_EXPECTED_NAMES = {
    "$END": "end of query",
    "SS_LOGIC": "&&, ||",
    "INTRINSIC": "an intrinsic (name, duration, ...)",
    "SCOPED_INTRINSIC": "span:<intrinsic>",
    "SCOPED_ATTR": "span.<attribute>",
    "UNSCOPED_ATTR": ".<attribute>",
    "IDENT": "a name",
    "STRING": "a string",
    "DURATION": "a duration",
    "FLOAT": "a number",
    "INT": "a number",
    "STATUS": "a status (ok, error, unset)",
    "KIND": "a kind (server, client, ...)",
    "AGG_FN": "avg, min, max, sum",
    "METRICS_FN": "a metrics function (rate, ...)",
}


def _expected(names) -> str:
    shown = set()
    for name in names:
        if name in _EXPECTED_NAMES:
            shown.add(_EXPECTED_NAMES[name])
            continue
        pattern = _parser().get_terminal(name).pattern
        value = pattern.value
        if pattern.type == "re":  # a keyword terminal: /(word|word)(?!...)/
            value = value.split(")")[0].lstrip("(").replace("|", ", ")
        shown.add(value)
    return "; ".join(sorted(shown))


@functools.lru_cache(maxsize=256)
def parse(text: str) -> ast.Query:
    """Parse one TraceQL query; raise TraceQLParseError naming where and what is wrong."""
    if not isinstance(text, str):
        raise TypeError("TraceQL query must be a string")
    if len(text) > MAX_QUERY_CHARS:
        raise TraceQLParseError(
            f"the query is {len(text)} characters, more than {MAX_QUERY_CHARS}",
            line=1,
            column=1,
            offset=0,
            token=text[:20],
        )
    try:
        tree = _parser().parse(text)
    except lark.UnexpectedToken as exc:
        tok = exc.token
        at_end = tok.type == "$END"
        offset = len(text) if at_end else tok.start_pos
        line, column = _line_col(text, offset)
        what = "query ends too early" if at_end else "unexpected token"
        raise TraceQLParseError(
            f"{what}; expected {_expected(exc.expected)}",
            line=line,
            column=column,
            offset=offset,
            token="" if at_end else str(tok),
        ) from None
    except lark.UnexpectedCharacters as exc:
        token = re.match(r"\S+", text[exc.pos_in_stream :])
        raise TraceQLParseError(
            "unexpected character",
            line=exc.line,
            column=exc.column,
            offset=exc.pos_in_stream,
            token=token.group(0)[:20] if token else text[exc.pos_in_stream],
        ) from None
    except lark.UnexpectedEOF as exc:
        line, column = _line_col(text, len(text))
        raise TraceQLParseError(
            f"query ends too early; expected {_expected(exc.expected)}",
            line=line,
            column=column,
            offset=len(text),
            token="",
        ) from None
    try:
        query = _ToAst(text).transform(tree)
    except lark.exceptions.VisitError as exc:
        if isinstance(exc.orig_exc, TraceQLParseError):
            raise exc.orig_exc from None
        if isinstance(exc.orig_exc, RecursionError):
            raise _too_deep(text) from None
        raise
    except RecursionError:
        raise _too_deep(text) from None
    if _depth(query) > MAX_DEPTH:
        raise _too_deep(text)
    return validate(query)


def _too_deep(text: str) -> TraceQLParseError:
    line, column = _line_col(text, 0)
    return TraceQLParseError(
        f"the query nests more than {MAX_DEPTH} operators deep",
        line=line,
        column=column,
        offset=0,
        token=text[:20],
    )


def _depth(node) -> int:
    """The depth of the AST, without recursion (the evaluator recurses that deep)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in dataclasses.fields(item):
                value = getattr(item, f.name)
                for child in value if isinstance(value, tuple) else (value,):
                    if dataclasses.is_dataclass(child):
                        stack.append((child, depth + 1))
    return deepest


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column
