"""The pure searches over `fits`, torch-free: the largest micro-batch that fits (micro_batch)
and the longest sequence that fits at a given micro-batch (sequence)."""
