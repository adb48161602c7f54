"""shardserve: the one import namespace, and the console script's home.

Each folder of the repository installs under this name (``serving/`` is ``shardserve.serving``,
``models/`` is ``shardserve.models``: setup.py). This package itself holds the console script
(``shardserve.cli`` dispatches to the subcommands each package defines); it is the only one that
imports serving, training, partitioner and loadtest together, and none of them imports it, but
for ``__version__`` below. Keep this file free of imports: every ``shardserve.*`` import runs it.
"""

__version__ = "0.1.0"  # the one place: pyproject reads it, `shardserve --version` and /v2 print it
