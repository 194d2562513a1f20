"""Fixtures shared by the integration tests: the distributed-mode `cluster` lives beside the
tests that introduced it and is offered to every integration module from here."""

from tests.integration.test_distributed import cluster  # noqa: F401
