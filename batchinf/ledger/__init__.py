"""The ledger: the source of truth for jobs, shards and attempts."""
