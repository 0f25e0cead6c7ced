"""Devices a trial runs on: the `Device` contract, the emulated GPU, the real CUDA device with
the runtime it talks to (real or simulated), NVML, and the one module that catches
out-of-memory."""
