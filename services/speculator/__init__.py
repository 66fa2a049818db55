"""The speculator service: draft tokens for decode workers' speculative decoding.

``core`` (no gRPC) proposes drafts from prompt lookup and a shared suffix
index, and optionally from a draft model (``draft_model``, which
``draft_worker`` runs on a thread of its own); ``server``/``main`` serve it;
``client.SpeculatorProposer`` is the decode worker's side of the stream and
``local.LocalProposer`` runs the core inside the engine's process.
"""
