"""kvmesh: a disaggregated LLM inference server."""
