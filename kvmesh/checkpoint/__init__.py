"""Checkpoints on disk: a Hugging Face folder's safetensors (``files``), the weight quantization formats
(``formats``) and the compressed-tensors layout that stores them (``compressed``). Below the engine, which
loads through it, and the quantization tool (``kvmesh.quant``), which writes through it."""
