"""The memory model, torch-free: the CUDA caching allocator's policy, its settings and blocks,
traces replayed through it, kernels' scratch, and DDP's gradient buckets."""
