"""The prefill service: computes a prompt's KV and first token, hands the KV to decode."""
