"""Spans built on demand from stored rows; nothing stores spans.

store/ ──▶ builders.py   a wave's spans (the CLI, TraceQL, the query API and OTLP use it)
           query.py      one trace's spans by id
           requests.py   request traces, linked both ways with wave traces
           timeline.py   stored waves as a Perfetto / chrome://tracing timeline
"""
