"""The package list, computed (pyproject.toml holds everything else).

backends/ installs as finetune.backends (pyproject's package-dir), and every folder under it with
an ``__init__.py`` as finetune.backends.<name>: a new backend is its folder, its YAML and one line
of the registry (backends/__init__.py ``BACKENDS``), in a wheel as in a checkout, with no list here
or in pyproject.toml to extend (tests/test_third_backend.py builds the wheel to check).
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["finetune", "finetune.*"]), "finetune.conf",
                *(f"finetune.{name}" for name in find_packages(include=["backends", "backends.*"]))])
