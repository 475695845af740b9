"""A worker process of `pdplane registry --workers N`: serves the public port and forwards to
the process that holds the store (heartbeats in batches)."""
