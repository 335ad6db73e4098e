"""One module per ``stageload`` subcommand.

Each module defines ``HELP`` (one line), ``DESCRIPTION`` (the ``--help`` text),
``add_arguments(parser)`` and ``run(args) -> int``. Modules must import nothing heavy at
import time: ``stageload --help`` loads all of them.
"""
