"""The TraceQL parser: every supported construct to its typed tree, errors that name the line,
the column and the offending token, and random input that never crashes it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telemetry.traceql import TraceQLParseError, ast, parse
from telemetry.traceql.fields import attribute_key, kind_keys, short_names
from telemetry.traceql.parser import parse_duration

A, IN, S = ast.Attribute, ast.Intrinsic, ast.Static


def _expr(text: str):
    return parse(text).spanset.expr


# -- spanset filters ---------------------------------------------------------------------------


def test_empty_filter_matches_everything():
    assert parse("{}") == ast.Query(ast.SpansetFilter(None))
    assert parse("  {  }  ").spanset == ast.SpansetFilter(None)


@pytest.mark.parametrize("name", ast.INTRINSICS)
def test_every_intrinsic(name):
    cmp = _expr(f"{{ {name} != nil }}")
    assert cmp.left == IN(name) and cmp.op == "!="


@pytest.mark.parametrize(
    ("text", "name"),
    [("span:duration", "duration"), ("span:name", "name"), ("trace:duration", "traceDuration"),
     ("trace:rootName", "rootName"), ("span:status", "status"), ("span:kind", "kind")],
)  # fmt: skip
def test_scoped_intrinsics(text, name):
    assert _expr(f"{{ {text} != nil }}").left == IN(name)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (".tp", A("tp")),
        ("span.tp", A("tp", "span")),
        ("resource.service.name", A("service.name", "resource")),
        (".http.status_code", A("http.status_code")),
        ("span.ascend_guard.collective.op", A("ascend_guard.collective.op", "span")),
        (".num_reqs", A("num_reqs")),
    ],
)
def test_attributes_scoped_and_unscoped(text, field):
    assert _expr(f"{{ {text} = 1 }}").left == field


@pytest.mark.parametrize(
    "coordinate",
    ["dp", "tp", "pp", "wave", "engine", "run", "request", "op", "group", "bytes", "num_reqs"],
)
def test_the_issue_attributes_name_keys_the_builder_emits(coordinate):
    key = attribute_key(coordinate)
    assert any(key in keys for keys in kind_keys().values()), key


def test_every_emitted_key_has_one_short_name():
    emitted = set().union(*kind_keys().values())
    names = short_names()
    assert emitted <= set(names.values())
    for key in emitted:
        assert names[key.removeprefix("ascend_guard.")] == key


@pytest.mark.parametrize("op", ast.CMP_OPS)
def test_every_comparison_operator(op):
    value = '"a.*"' if op in ("=~", "!~") else "3"
    cmp = _expr(f"{{ .tp {op} {value} }}")
    assert cmp.op == op and cmp.left == A("tp")
    assert (cmp.pattern is not None) == (op in ("=~", "!~"))


def test_regex_is_compiled_once_and_anchored_by_the_evaluator():
    cmp = _expr('{ name =~ "collective:.*" }')
    assert cmp.pattern.pattern == "collective:.*"


@pytest.mark.parametrize(
    ("text", "value", "type_"),
    [
        ('"all_reduce"', "all_reduce", "string"),
        ('"a\\"b"', 'a"b', "string"),
        ("`raw\\n`", "raw\\n", "string"),
        ("42", 42, "int"),
        ("-7", -7, "int"),
        ("1.5", 1.5, "float"),
        (".99", 0.99, "float"),
        ("1e9", 1e9, "float"),
        ("true", True, "bool"),
        ("false", False, "bool"),
        ("nil", None, "nil"),
        ("error", "error", "status"),
        ("ok", "ok", "status"),
        ("internal", "internal", "kind"),
        ("50ms", 50_000_000, "duration"),
        ("1.5s", 1_500_000_000, "duration"),
        ("200us", 200_000, "duration"),
        ("200µs", 200_000, "duration"),
        ("10ns", 10, "duration"),
        ("1h30m", 5_400_000_000_000, "duration"),
        ("2m", 120_000_000_000, "duration"),
    ],
)
def test_statics(text, value, type_):
    static = _expr(f"{{ .x = {text} }}").right
    assert (static.value, static.type) == (value, type_)


def test_duration_arithmetic_is_exact():
    assert parse_duration("1.005s") == 1_005_000_000
    assert parse_duration("-5s") == -5_000_000_000


def test_and_or_share_one_level_left_to_right_as_in_tempo():
    e = _expr("{ .a = 1 || .b = 2 && .c = 3 }")
    assert e.op == "&&" and e.left.op == "||"
    e = _expr("{ .a = 1 || (.b = 2 && .c = 3) }")
    assert e.op == "||" and e.right.op == "&&"


def test_not_and_parentheses():
    e = _expr('{ !(.a = 1) && name = "rank" }')
    assert isinstance(e.left, ast.Not) and e.left.operand == ast.Comparison(
        "=", A("a"), S(1, "int", "1")
    )


def test_whitespace_and_newlines_are_optional():
    assert parse('{.tp=1&&name="rank"}') == parse('{\n  .tp = 1\n  && name = "rank"\n}')


# -- between spansets ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["&&", "||", ">", ">>", "~", "<", "<<"])
def test_spanset_operators(op):
    q = parse(f'{{ .tp = 1 }} {op} {{ .op = "all_reduce" }}')
    assert isinstance(q.spanset, ast.SpansetOp) and q.spanset.op == op
    assert q.spanset.left == ast.SpansetFilter(_expr("{ .tp = 1 }"))


def test_structural_binds_tighter_than_and_or():
    q = parse("{ .a = 1 } && { .b = 1 } >> { .c = 1 }")
    assert q.spanset.op == "&&" and q.spanset.right.op == ">>"
    q = parse("({ .a = 1 } && { .b = 1 }) >> { .c = 1 }")
    assert q.spanset.op == ">>" and q.spanset.left.op == "&&"


# -- pipelines, metrics, hints --------------------------------------------------------------------


def test_pipeline_stages():
    q = parse('{ name = "rank" } | by(.tp) | count() > 2 | avg(duration) > 50ms | select(.op, span.bytes) | { .tp = 1 } | coalesce()')  # fmt: skip
    by, count, avg, select, filt, coalesce = q.stages
    assert by == ast.GroupBy((A("tp"),))
    assert count == ast.ScalarFilter(ast.Aggregate("count", None), ">", S(2, "int", "2"))
    assert avg.aggregate == ast.Aggregate("avg", IN("duration")) and avg.value.value == 50_000_000
    assert select == ast.Select((A("op"), A("bytes", "span")))
    assert filt == ast.SpansetFilter(_expr("{ .tp = 1 }"))
    assert coalesce == ast.Coalesce()
    assert q.metrics is None


@pytest.mark.parametrize("fn", ["min", "max", "sum"])
def test_other_aggregates(fn):
    (stage,) = parse(f"{{ }} | {fn}(.bytes) >= 1e9").stages
    assert stage.aggregate == ast.Aggregate(fn, A("bytes")) and stage.op == ">="


@pytest.mark.parametrize(
    ("text", "metric"),
    [
        ("{ } | rate()", ast.MetricsAggregate("rate")),
        ("{ } | count_over_time() by (.tp)", ast.MetricsAggregate("count_over_time", by=(A("tp"),))),
        ("{ } | rate() by(.tp, resource.host.name)",
         ast.MetricsAggregate("rate", by=(A("tp"), A("host.name", "resource")))),
        ("{ } | quantile_over_time(duration, .99) by (.tp)",
         ast.MetricsAggregate("quantile_over_time", IN("duration"), (0.99,), (A("tp"),))),
        ("{ } | quantile_over_time(duration, 0.5, 0.9, 1)",
         ast.MetricsAggregate("quantile_over_time", IN("duration"), (0.5, 0.9, 1.0))),
        ("{ } | avg_over_time(.bytes)", ast.MetricsAggregate("avg_over_time", A("bytes"))),
    ],
)  # fmt: skip
def test_metrics(text, metric):
    assert parse(text).metrics == metric


def test_metrics_after_a_pipeline_and_hints():
    q = parse(
        '{ .tp = 1 } | { name = "rank" } | rate() by (.wave) with(most_recent=true, sample=0.5)'
    )
    assert len(q.stages) == 1 and q.metrics.fn == "rate"
    assert q.hints == (("most_recent", S(True, "bool", "true")), ("sample", S(0.5, "float", "0.5")))


@pytest.mark.parametrize(
    "text",
    [
        '{ .tp = 1 && name = "collective:all_reduce" && duration > 50ms }',
        "{ } | quantile_over_time(duration, 0.99) by(.tp)",
        '({ name = "rank" } >> { .op =~ "all_.*" }) | count() > 1',
        "{ .a = 1 } | by(.tp) | select(.op)",
    ],
)
def test_printed_query_parses_back_to_the_same_tree(text):
    q = parse(text)
    assert parse(str(q)) == q


# -- errors name the position and the token ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "column", "token", "reason"),
    [
        ("{ .tp = }", 1, 9, "}", "unexpected token"),
        ("{ foo = 1 }", 1, 3, "foo", "unknown identifier"),
        ("{ .a = 1 } |", 1, 13, "", "ends too early"),
        ("abc", 1, 1, "abc", "unexpected token"),
        ("{ .a = 1 }}", 1, 11, "}", "unexpected token"),
        ("{\n  .tp = 1 &&\n}", 3, 1, "}", "unexpected token"),
        ("{ .a = @ }", 1, 8, "@", "unexpected character"),
        ('{ .a =~ "(" }', 1, 6, "=~", "bad regular expression"),
        ("{ .a =~ 3 }", 1, 6, "=~", "string regular expression"),
        ("{ .a = 1 } !- { .b = 1 }", 1, 12, "!", "unexpected token"),
        ("{ } | rate() | count() > 1", 1, 7, "rate", "last stage"),
        ("{ } | rate(duration)", 1, 7, "rate", "no arguments"),
        ("{ } | quantile_over_time(duration, 2)", 1, 7, "quantile_over_time", "[0, 1]"),
        ("{ } | quantile_over_time(duration)", 1, 7, "quantile_over_time", "quantiles"),
        ('{ } | count() > "a"', 1, 15, ">", "a number"),
        ("{ span:bogus = 1 }", 1, 3, "span:bogus", "unknown scoped intrinsic"),
        ("{ .a = 1 } &| { .b = 1 }", 1, 12, "&|", "unexpected character"),
    ],
)
def test_errors_name_line_column_and_token(text, line, column, token, reason):
    with pytest.raises(TraceQLParseError) as info:
        parse(text)
    err = info.value
    assert (err.line, err.column, err.token) == (line, column, token), str(err)
    assert reason in str(err)
    assert f"line {line}, column {column}" in str(err)
    lines = text.split("\n")
    if token:
        assert lines[line - 1][column - 1 :].startswith(token)
        assert text[err.offset :].startswith(token)


def test_expected_tokens_are_named():
    with pytest.raises(TraceQLParseError) as info:
        parse("{ .tp = 1 } | ")
    assert "count" in str(info.value) and "{" in str(info.value)


# -- random input ------------------------------------------------------------------------------
_PIECES = ["{", "}", "(", ")", "|", "&&", "||", ">", ">>", "~", "=", "!=", "=~", "!~", "<", "<=",
           ".tp", "span.op", "resource.x", "name", "duration", "50ms", "1.5", ".99", "3", "-2",
           '"a"', '"', "count()", "avg(", "by", "select", "rate()", "quantile_over_time",
           ",", "nil", "true", "error", "with", "!", " ", "\n", "µs", "`", "\\", "+", "-", "*", "/",
           "%", "^", "!>", "&>>", "!~", "&~", "event:name", "link.x", "nestedSetLeft", "span:id",
           "histogram_over_time(duration)", "max(duration)"]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(st.text(max_size=60), st.lists(st.sampled_from(_PIECES), max_size=25).map("".join))
)
def test_random_strings_parse_or_raise_the_parse_error(text):
    try:
        query = parse(text)
    except TraceQLParseError as err:
        assert err.line >= 1 and err.column >= 1 and 0 <= err.offset <= len(text)
        assert err.token == "" or err.token in text
    else:
        assert isinstance(query, ast.Query)
        assert parse(str(query)) == query


def test_every_example_in_the_docs_parses():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "traceql.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```traceql\n")[1:]]
    examples = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert len(examples) >= 10
    for example in examples:
        parse(example)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{ " + " && ".join([".a = 1"] * 1000) + " }", "nests more than"),
        ("{ " + "!" * 3000 + ".a = 1 }", "nests more than"),
        (" && ".join(["{ .a = 1 }"] * 1000), "nests more than"),
        ("{ .a = " + "1" * 20000 + " }", "characters, more than"),
    ],
)
def test_huge_or_deep_queries_are_parse_errors_not_crashes(text, reason):
    with pytest.raises(TraceQLParseError, match=reason):
        parse(text)


def test_deep_but_allowed_queries_parse():
    parse("{ " + " && ".join([".a = 1"] * 100) + " }")
    parse("(" * 500 + "{ .a = 1 }" + ")" * 500)
