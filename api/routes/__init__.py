"""One router per resource: runs (users), worker (the probe-worker protocol), health."""
