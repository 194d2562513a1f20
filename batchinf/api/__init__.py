"""The REST API (`batchinf serve`): a thin FastAPI layer over the library; no business logic here."""

from batchinf.api.app import create_app

__all__ = ["create_app"]
