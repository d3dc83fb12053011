"""`ascend-guard`, the composition root: main.py assembles one module per subcommand from
commands/; args.py, source.py (the sidecar's API, or the store file), render.py, follow.py,
table.py and http_client.py are what the commands share. Only here may telemetry import the
worker side (`config check`, `doctor`), lazily.
"""
