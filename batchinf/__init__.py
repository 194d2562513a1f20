"""batchinf: durable asynchronous batch inference over object storage."""

__version__ = "0.1.0"
