"""``python -m shardserve ...`` is the ``shardserve`` console script."""

import sys

from shardserve.cli import main

sys.exit(main())
