"""The shared engine that prefill and decode both run: model, paged KV, scheduler, sampler.

Import what you use from its modules (``kvmesh.engine.engine.LLMEngine``, ``kvmesh.engine.config``): this
package imports nothing itself, so a torch-free module of it (the tokenizer) loads without torch.
"""
