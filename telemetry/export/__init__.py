"""OTLP export of wave spans to the cluster's trace backend, off the ingest path, tail-sampled
(otlp.py): a sink of the pipeline's writer.
"""
