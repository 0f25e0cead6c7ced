"""What the tuner searches and answers, torch-free: its search space (candidates), how a
configuration's speed is timed (throughput), which measured one to recommend (ranking) and
the invariants every result keeps (result_check)."""
