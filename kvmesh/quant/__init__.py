"""Weight quantization: formats, compressed-tensors checkpoints, fidelity reports, plan search."""
