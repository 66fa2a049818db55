"""Checking a served OpenAI-compatible endpoint against the golden implementation."""
