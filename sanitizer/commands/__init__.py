"""One module per `hazsan` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``
(the exit code). `sanitizer.cli` discovers them, so adding a command touches only its own file.
Command modules import their heavy machinery inside ``run`` so that `hazsan --help` stays fast.
"""
