"""The decode service: adopts prefilled KV, batches many sequences, streams their tokens."""
