"""What the tests and the benchmarks under bench/ share: an OTLP trace receiver (`otlp`), a
closed-loop load generator (`loadgen`), the sims' counters over a window (`routing_stats`), the
scheduler replicas' scenario (`replicas`), KV node processes on a GPU (`nccl_cluster`,
`nccl_node`), an engine's cached blocks rebuilt from a KvEvents stream (`kv_replica`) and the
one `percentile` (`stats`). Imports nothing of bench/."""
