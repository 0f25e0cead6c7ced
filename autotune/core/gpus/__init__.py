"""Named GPUs, torch-free: the catalogue, what CUDA takes on each card, and an op's time by the
roofline."""
