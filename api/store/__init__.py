"""The run store: engines and sessions, the ORM rows and their one converter, runs as users see
them, workers' leases and results, the cached answers, reads that expire lapsed leases, and the
long-poll watcher."""
