"""The bundle registry's tables: bundles (by content digest) and their NAME@ALIAS pointers."""

from __future__ import annotations

from sqlalchemy import Connection, insert, select, update

from batchinf.errors import BundleError
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.models import BundleInfo
from batchinf.ledger.tables import bundle_aliases, bundles


def add(digest: str, name: str, uri: str, task: str, family: str, meta: str, alias: str | None) -> None:
    """Register an imported bundle (once per digest) and point NAME@ALIAS at it."""
    with tx() as conn:
        if conn.execute(select(bundles.c.digest).where(bundles.c.digest == digest)).first() is None:
            conn.execute(insert(bundles).values(digest=digest, name=name, uri=uri, task=task, family=family,
                                                meta=meta, created_at=now()))
        if alias:
            _set_alias(conn, name, alias, digest)


def _set_alias(conn: Connection, name: str, alias: str, digest: str) -> None:
    """Point NAME@ALIAS at `digest`: a bundle of the same task as NAME's other bundles (the ones
    named NAME and the ones its aliases point at), so a manifest's `bundle:` never silently changes task."""
    target = conn.execute(select(bundles.c.name, bundles.c.task).where(bundles.c.digest == digest)).first()
    if target is None:
        raise BundleError(f"no bundle with digest {digest}; see `batchinf bundle list`")
    others = conn.execute(select(bundles.c.digest, bundles.c.task).where(
        (bundles.c.name == name) | bundles.c.digest.in_(
            select(bundle_aliases.c.digest).where(bundle_aliases.c.name == name, bundle_aliases.c.alias != alias)))
    ).all()
    clash = sorted({task for d, task in others if task != target.task})
    if clash:
        raise BundleError(f"{name}@{alias} cannot point at {digest}: that is a {target.task} bundle "
                          f"({target.name}), and {name}'s bundles are {', '.join(clash)}; "
                          f"use another name, e.g. {target.name}@{alias}")
    if not conn.execute(update(bundle_aliases).where(bundle_aliases.c.name == name, bundle_aliases.c.alias == alias)
                        .values(digest=digest, updated_at=now())).rowcount:
        conn.execute(insert(bundle_aliases).values(name=name, alias=alias, digest=digest, updated_at=now()))


def set_alias(name: str, alias: str, digest: str) -> None:
    with tx() as conn:
        _set_alias(conn, name, alias, digest)


def resolve(ref: str) -> str | None:
    """NAME (newest import), NAME@ALIAS, or sha256:HEX -> digest, or None."""
    if ref.startswith("sha256:"):
        q = select(bundles.c.digest).where(bundles.c.digest == ref)
    elif "@" in ref:
        name, alias = ref.split("@", 1)
        q = select(bundle_aliases.c.digest).where(bundle_aliases.c.name == name, bundle_aliases.c.alias == alias)
    else:
        q = select(bundles.c.digest).where(bundles.c.name == ref).order_by(bundles.c.created_at.desc()).limit(1)
    with tx() as conn:
        return conn.execute(q).scalar()


def get(digest: str) -> BundleInfo:
    with tx() as conn:
        row = conn.execute(select(bundles).where(bundles.c.digest == digest)).first()
        if row is None:
            raise BundleError(f"no bundle with digest {digest}")
        aliases = conn.execute(select(bundle_aliases.c.name, bundle_aliases.c.alias)
                               .where(bundle_aliases.c.digest == digest)).all()
    return BundleInfo(row.digest, row.name, row.uri, row.task, row.family, row.created_at,
                      tuple(f"{n}@{a}" for n, a in aliases))


def all_bundles() -> list[BundleInfo]:
    with tx() as conn:
        digests = conn.execute(select(bundles.c.digest).order_by(bundles.c.name, bundles.c.created_at)).scalars().all()
    return [get(d) for d in digests]


def meta(digest: str) -> dict:
    """The bundle's bundle.json as imported (stored verbatim in the registry)."""
    import json

    with tx() as conn:
        raw = conn.execute(select(bundles.c.meta).where(bundles.c.digest == digest)).scalar()
    if raw is None:
        raise BundleError(f"no bundle with digest {digest}")
    return json.loads(raw)
