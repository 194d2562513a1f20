"""The OpenAI Batch API: request lines in, files and batches over the ledger, output lines out."""
