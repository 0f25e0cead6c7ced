"""The torch side: models, the training step, the emulated and CUDA devices, the probe and the
tuner."""
