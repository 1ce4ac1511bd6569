"""The native CPU path: quantized linear layers, the C++ kernels behind them, and the whole-stack decoder.

Everything here computes what the pure-PyTorch modules in models/ compute, only faster on x86-64 CPUs; a first
read of the engine can skip this package (see README.md).
"""
