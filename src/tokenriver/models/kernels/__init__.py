"""Native CPU kernels (C++ compiled at first use) behind the quantized layers of models/quant.py."""
