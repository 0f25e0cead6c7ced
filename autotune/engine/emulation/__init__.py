"""What makes a CPU step count as a GPU's: the live-byte tracker, CUDA's autocast policy and
fused kernels (attention, softmax) as a GPU keeps them, and a named GPU's speed by the
roofline."""
