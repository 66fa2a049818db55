"""Structured outputs: what a request's grammar is, and whether it can be enforced.

``spec`` is the one description of a constraint (kind + source text) that the
gateway validates and the workers compile; ``json_schema`` refuses schemas the
grammar could not enforce. Compiling against a tokenizer lives with the engine
(``kvmesh.engine.grammar``), since only workers have the model's vocabulary.
"""
