"""The contract between a worker and the sidecar, imported by both ends.

proto/            the schema of every record (guard.proto and its generated code)
schema.py         a wave's names, ranges and span attributes, derived from the proto
*_columns.py      wave, collective and request records as columns, and their readers
liveness_record   the shared-memory record a frozen rank is read from (writer and reader)
trace_ids.py      deterministic trace and span ids: traces join across processes and nodes
protobuf_fields.py  one length-delimited field's bytes, for code that appends encoded fields
probes.py, labels.py, replica.py   the probe names a worker may send, bounded label values,
                  what one replica is
paths.py, addresses.py, transport.py, build_info.py, logs.py   where things live, how the
                  ends connect and secure it, what is running, how it logs
"""
