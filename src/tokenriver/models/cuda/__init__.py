"""The CUDA path: Triton kernels for quantized layers whose tensors live on an NVIDIA GPU."""
