"""router: picks the prefill and decode workers for each request.

``core.Router`` ties together the worker registry (``registry``, shared via
``registry_store``), the Redis prefix-hash index (``index``, fed by
``events``) and the decision (``policy``). No gRPC here; the servicer and the
entry point are thin layers over ``core``.
"""
