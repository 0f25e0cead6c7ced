"""The memory model, torch-free: the CUDA caching allocator's policy, its settings and blocks,
traces replayed through it, kernels' scratch, DDP's gradient buckets, and 8-bit AdamW's states."""
