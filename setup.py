"""One import namespace: the repository's top-level folders install as ``shardserve.<folder>``.

``serving/`` is ``shardserve.serving``, ``models/`` is ``shardserve.models``, and so on (setuptools'
``package_dir``), so the wheel and the editable install both hold a single top-level package,
``shardserve``, while the folders stay where the design puts them. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("models", "partitioner", "serving", "training", "loadtest")  # each becomes shardserve.<folder>

package_dir = {"shardserve": "shardserve", **{f"shardserve.{f}": f for f in FOLDERS}}
packages = ["shardserve"] + [
    f"shardserve.{f}{sub}"
    for f in FOLDERS
    for sub in ["", *(f".{p}" for p in find_packages(where=f))]
]

setup(package_dir=package_dir, packages=packages)
