"""Worker entry points: thin wrappers that call batchinf.

Embedded mode runs shards in local processes (`batchinf.dispatch.worker_main`); the Celery app
for distributed mode belongs here and calls the same `batchinf.dispatch.run_lease`.
"""
