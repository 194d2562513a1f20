"""The Store contract (tests/helpers/store_contract.py) on a real (moto) S3 server, in a versioned
bucket, and what an unversioned bucket does; the same contract runs on local files in
tests/unit/test_store_contract_local.py."""

from __future__ import annotations

import pytest

from batchinf.errors import InputError
from batchinf.store import get_store, join
from tests.helpers.services import make_bucket
from tests.helpers.store_contract import *  # noqa: F403 -- the contract's tests, collected here

pytestmark = pytest.mark.integration


@pytest.fixture
def store_root(s3_bucket: str) -> str:
    return join(s3_bucket, "root")


def test_s3_unversioned_overwrite_fails_if_match(s3_server: str) -> None:
    root = make_bucket(versioned=False)
    store, uri = get_store(root), join(root, "k.txt")
    store.put_bytes(uri, b"old")
    old = store.head(uri)
    assert old.version_id is None and store.list(root) == [old]
    store.put_bytes(uri, b"new")
    with pytest.raises(InputError, match=f"{uri}.*etag {old.etag}, now .*re-submit"):
        with store.open_read(old):
            pass
    store.delete(uri)
    with pytest.raises(InputError, match=f"{uri}.*now missing"):
        with store.open_read(old):
            pass
