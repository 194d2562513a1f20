"""Packages are found, never listed: everything under batchinf/, plus workers/ and migrations/,
which stay at the top of the repository and install as batchinf.workers and batchinf.migrations."""

from setuptools import find_packages, setup

MAPPED = {"workers": "batchinf.workers", "migrations": "batchinf.migrations"}

packages = find_packages(include=["batchinf", "batchinf.*"])
package_dir = {}
for top, name in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(top)]
    package_dir[name] = top

setup(packages=packages, package_dir=package_dir)
