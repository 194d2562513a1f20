"""scale: running totals per job kept by triggers (job_tallies; on PostgreSQL through an
append-only job_tally_deltas that the running tick folds in), so status, the error budget and the
metrics cost what changed instead of a scan of every shard; jobs.error_records keeps only the
planning-time count (computed shards' error rows come from the tallies, so a commit no longer
writes the job's row); indexes of the attempts still open and of shards' parents

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

SUMS = ("n", "records", "output_rows", "error_rows", "tokens_input", "tokens_real", "tokens_padded",
        "execute_seconds", "worker_seconds")
COLUMNS = "job_id, key, " + ", ".join(SUMS)
# a shard's contribution to its tally row, from its row `r`, with sign `sign`
SHARD_SOURCES = {"records": "num_records", "output_rows": "output_rows", "error_rows": "error_rows",
                 "tokens_input": "tokens_input", "tokens_real": "tokens_real", "tokens_padded": "tokens_padded",
                 "execute_seconds": "execute_seconds"}
WATCHED = ("status", "bucket", "num_records", "output_rows", "error_rows", "tokens_input", "tokens_real",
           "tokens_padded", "execute_seconds")


def _shard_key(r: str) -> str:
    return f"CASE WHEN {r}.bucket < 0 THEN 'v:' ELSE 's:' END || {r}.status"


def _shard_row(r: str, sign: str) -> str:
    """VALUES of one shard's tally delta."""
    sums = [f"{sign}1"] + [f"{sign}COALESCE({r}.{SHARD_SOURCES[s]}, 0)" for s in SUMS[1:-1]] + ["0"]
    return f"{r}.job_id, {_shard_key(r)}, " + ", ".join(sums)


def _shard_group(table: str, sign: str) -> str:
    """SELECT of a statement's shards' tally deltas, one per (job, key)."""
    sums = [f"{sign}COUNT(*)"] + [f"{sign}SUM(COALESCE(r.{SHARD_SOURCES[s]}, 0))" for s in SUMS[1:-1]] + ["0"]
    return f"SELECT r.job_id, {_shard_key('r')}, " + ", ".join(sums) + f" FROM {table} r GROUP BY 1, 2"


def _zeros(first: str, *, seconds: str = "0") -> str:
    return ", ".join([first] + ["0"] * (len(SUMS) - 2) + [seconds])


def _upsert() -> str:
    """SQLite's upsert of a tally row (a bare column name is the existing row's value)."""
    return " ON CONFLICT (job_id, key) DO UPDATE SET " + ", ".join(f"{s} = {s} + excluded.{s}" for s in SUMS)


def _changed(old: str, new: str, distinct: str) -> str:
    return " OR ".join(f"{old}.{c} {distinct} {new}.{c}" for c in WATCHED)


POSTGRES = [
    f"""CREATE FUNCTION batchinf_tally_shard_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO job_tally_deltas ({COLUMNS}) {_shard_group('new_rows', '')};
  ELSE
    INSERT INTO job_tally_deltas ({COLUMNS}) {_shard_group('old_rows', '-')};
  END IF;
  RETURN NULL;
END $$""",
    f"""CREATE FUNCTION batchinf_tally_shard_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO job_tally_deltas ({COLUMNS}) VALUES ({_shard_row('OLD', '-')}), ({_shard_row('NEW', '')});
  RETURN NULL;
END $$""",
    f"""CREATE FUNCTION batchinf_tally_error_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO job_tally_deltas ({COLUMNS}) SELECT job_id, 'e:' || error, {_zeros('COUNT(*)')} FROM new_rows GROUP BY 1, 2;
  ELSE
    INSERT INTO job_tally_deltas ({COLUMNS}) SELECT job_id, 'e:' || error, {_zeros('-COUNT(*)')} FROM old_rows GROUP BY 1, 2;
  END IF;
  RETURN NULL;
END $$""",
    f"""CREATE FUNCTION batchinf_tally_attempt_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO job_tally_deltas ({COLUMNS})
    SELECT s.job_id, 'w', {_zeros('0', seconds='NEW.finished_at - NEW.started_at')} FROM shards s WHERE s.id = NEW.shard_id;
  RETURN NULL;
END $$""",
    "CREATE TRIGGER tally_shards_insert AFTER INSERT ON shards REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION batchinf_tally_shard_rows()",
    "CREATE TRIGGER tally_shards_delete AFTER DELETE ON shards REFERENCING OLD TABLE AS old_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION batchinf_tally_shard_rows()",
    f"CREATE TRIGGER tally_shards_update AFTER UPDATE OF {', '.join(WATCHED)} ON shards FOR EACH ROW "
    f"WHEN ({_changed('OLD', 'NEW', 'IS DISTINCT FROM')}) EXECUTE FUNCTION batchinf_tally_shard_update()",
    "CREATE TRIGGER tally_errors_insert AFTER INSERT ON record_errors REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION batchinf_tally_error_rows()",
    "CREATE TRIGGER tally_errors_delete AFTER DELETE ON record_errors REFERENCING OLD TABLE AS old_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION batchinf_tally_error_rows()",
    "CREATE TRIGGER tally_attempts_end AFTER UPDATE OF finished_at ON attempts FOR EACH ROW "
    "WHEN (OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL) EXECUTE FUNCTION batchinf_tally_attempt_end()",
]
POSTGRES_DROP = [
    "DROP TRIGGER IF EXISTS tally_shards_insert ON shards", "DROP TRIGGER IF EXISTS tally_shards_delete ON shards",
    "DROP TRIGGER IF EXISTS tally_shards_update ON shards", "DROP TRIGGER IF EXISTS tally_errors_insert ON record_errors",
    "DROP TRIGGER IF EXISTS tally_errors_delete ON record_errors",
    "DROP TRIGGER IF EXISTS tally_attempts_end ON attempts",
    "DROP FUNCTION IF EXISTS batchinf_tally_shard_rows()", "DROP FUNCTION IF EXISTS batchinf_tally_shard_update()",
    "DROP FUNCTION IF EXISTS batchinf_tally_error_rows()", "DROP FUNCTION IF EXISTS batchinf_tally_attempt_end()",
]

_UP = _upsert()      # SQLite: row triggers write the totals directly
SQLITE = [
    f"CREATE TRIGGER tally_shards_insert AFTER INSERT ON shards BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES ({_shard_row('NEW', '')}){_UP}; END",
    f"CREATE TRIGGER tally_shards_delete AFTER DELETE ON shards BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES ({_shard_row('OLD', '-')}){_UP}; END",
    f"CREATE TRIGGER tally_shards_update AFTER UPDATE OF {', '.join(WATCHED)} ON shards "
    f"WHEN {_changed('OLD', 'NEW', 'IS NOT')} BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES ({_shard_row('OLD', '-')}){_UP}; "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES ({_shard_row('NEW', '')}){_UP}; END",
    f"CREATE TRIGGER tally_errors_insert AFTER INSERT ON record_errors BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES (NEW.job_id, 'e:' || NEW.error, {_zeros('1')}){_UP}; END",
    f"CREATE TRIGGER tally_errors_delete AFTER DELETE ON record_errors BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) VALUES (OLD.job_id, 'e:' || OLD.error, {_zeros('-1')}){_UP}; END",
    f"CREATE TRIGGER tally_attempts_end AFTER UPDATE OF finished_at ON attempts "
    f"WHEN OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL BEGIN "
    f"INSERT INTO job_tallies ({COLUMNS}) SELECT s.job_id, 'w', "
    f"{_zeros('0', seconds='NEW.finished_at - NEW.started_at')} FROM shards s WHERE s.id = NEW.shard_id{_UP}; END",
]
SQLITE_DROP = [f"DROP TRIGGER IF EXISTS {name}" for name in (
    "tally_shards_insert", "tally_shards_delete", "tally_shards_update", "tally_errors_insert",
    "tally_errors_delete", "tally_attempts_end")]

BACKFILL = [
    f"INSERT INTO job_tallies ({COLUMNS}) {_shard_group('shards', '')}",
    f"INSERT INTO job_tallies ({COLUMNS}) SELECT job_id, 'e:' || error, {_zeros('COUNT(*)')} "
    "FROM record_errors GROUP BY job_id, error",
    f"INSERT INTO job_tallies ({COLUMNS}) SELECT s.job_id, 'w', {_zeros('0', seconds='SUM(a.finished_at - a.started_at)')} "
    "FROM attempts a JOIN shards s ON s.id = a.shard_id WHERE a.finished_at IS NOT NULL GROUP BY s.job_id",
    # planning-time failures only (the validation-error shards' records); computed shards' error
    # rows are tallied
    "UPDATE jobs SET error_records = (SELECT COALESCE(SUM(s.num_records), 0) FROM shards s "
    "WHERE s.job_id = jobs.id AND s.bucket < 0 AND s.parent_id IS NULL)",
]


def _tally_columns() -> list[sa.Column]:
    return [sa.Column(s, sa.Float() if s.endswith("seconds") else sa.BigInteger(), nullable=False,
                      server_default="0") for s in SUMS]


def upgrade() -> None:
    op.create_table('job_tallies',
                    sa.Column('job_id', sa.String(40), primary_key=True),
                    sa.Column('key', sa.String(80), primary_key=True),
                    *_tally_columns())
    op.create_table('job_tally_deltas',
                    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                              autoincrement=True),
                    sa.Column('job_id', sa.String(40), nullable=False),
                    sa.Column('key', sa.String(80), nullable=False),
                    *_tally_columns())
    op.create_index('ix_job_tally_deltas_job', 'job_tally_deltas', ['job_id'])
    op.create_index('ix_attempts_open', 'attempts', ['shard_id'], postgresql_where=sa.text('finished_at IS NULL'),
                    sqlite_where=sa.text('finished_at IS NULL'))
    op.create_index('ix_shards_parent', 'shards', ['parent_id'])
    for statement in BACKFILL:
        op.execute(statement)
    for statement in POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE:
        op.execute(statement)


def downgrade() -> None:
    for statement in POSTGRES_DROP if op.get_bind().dialect.name == "postgresql" else SQLITE_DROP:
        op.execute(statement)
    op.execute("UPDATE jobs SET error_records = (SELECT COALESCE(SUM(CASE WHEN s.bucket < 0 THEN s.num_records "
               "ELSE COALESCE(s.error_rows, 0) END), 0) FROM shards s WHERE s.job_id = jobs.id "
               "AND (s.parent_id IS NULL OR s.bucket >= 0))")
    op.drop_index('ix_attempts_open', table_name='attempts')
    op.drop_index('ix_shards_parent', table_name='shards')
    op.drop_index('ix_job_tally_deltas_job', table_name='job_tally_deltas')
    op.drop_table('job_tally_deltas')
    op.drop_table('job_tallies')
