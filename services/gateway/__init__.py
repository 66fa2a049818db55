"""The gateway: kvmesh's public gRPC API (tokenize, route, drive prefill -> decode, stream back)."""
