"""The one version source: pyproject.toml reads it (`[tool.setuptools.dynamic]`), and so do
`batchinf --version`, `batchinf info` and `batchinf_build_info`."""

__version__ = "0.1.0"
