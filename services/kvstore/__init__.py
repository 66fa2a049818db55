"""kvstore: the content-addressed store of KV blocks (RAM tier, disk tier).

``core`` holds the logic as plain Python objects; the gRPC servicer and the
entry point are thin layers over it.
"""
