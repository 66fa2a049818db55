"""Speculative decoding as a library: where drafts come from and how many to ask for.

Sources (proposers): prompt lookup in the request's own context (``prompt_lookup``), a suffix index shared
across requests (``suffix_index``), both behind ``speculator.Speculator``; a draft model (``draft_model``);
an EAGLE head on the target's hidden states (``eagle``). ``local.LocalProposer`` runs them in the engine's
process; the speculator service (``services/speculator``) serves ``Speculator`` over gRPC, and its
``client.py`` is the decode worker's proposer for it. ``drafter.Drafter`` is what the engine calls: it
asks a proposer for as many drafts per sequence as pay for their verify (``draft_length``, priced by
``verify_cost``).
"""
