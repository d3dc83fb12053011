"""The node sidecar put together: settings.py is every setting in one table (the CLI's flags are
generated from it), app.py builds ingest, crossrank, the pipeline and its sinks, the listeners
and the query API from those settings, and starts and stops them.
"""
