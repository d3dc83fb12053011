// Reads a JSON list of TraceQL queries on stdin; prints {query: offset of lezer's first error
// node, or null}. Run by tests/unit/telemetry/test_traceql_lezer.py with @grafana/lezer-traceql installed.
import { parser } from "@grafana/lezer-traceql";
import { readFileSync } from "fs";

const queries = JSON.parse(readFileSync(0, "utf8"));
const out = {};
for (const q of queries) {
  let bad = null;
  parser.parse(q).iterate({
    enter: (n) => {
      if (n.type.isError && bad === null) bad = n.from;
    },
  });
  out[q] = bad;
}
console.log(JSON.stringify(out));
