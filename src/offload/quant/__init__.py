"""Quantized weights as stored: GGUF's block formats and the layouts laid out for torch's
kernels, the packed safetensors formats (compressed-tensors, GPTQ, AWQ, FP8), the modules
that hold them and their products. Nothing here reads a checkpoint (`model/` does)."""
