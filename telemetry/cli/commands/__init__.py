"""The `ascend-guard` subcommands, one module each.

Every module has `add_parser(sub)`, which adds its subcommand (or subcommands) to the
`argparse` subparsers `sub`, and `run(args) -> int`, its handler. telemetry/cli/main.py assembles
them: adding a subcommand is one line in its `COMMANDS`.
"""
