"""batchinf: durable asynchronous batch inference over object storage."""

from pathlib import Path as _Path

from batchinf.version import __version__

# In a source checkout, workers/ and migrations/ sit beside batchinf/ (the repository's layout);
# an installed batchinf holds them as batchinf.workers and batchinf.migrations (pyproject's
# package-dir). The checkout imports them under the same names.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "workers" / "celery_app.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 -- a package's __path__

__all__ = ["__version__"]
