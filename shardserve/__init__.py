"""The console script's home: ``shardserve`` dispatches to the subcommands each package defines.

This is the only package that imports serving, training, partitioner and loadtest together; none
of them imports it (or each other's command lines), so no package depends on one above it.
"""
