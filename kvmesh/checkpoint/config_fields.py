"""Every field of a served family's ``config.json`` and what kvmesh does with it: no field that changes
the maths is ignored silently.

A field is ``HONOURED`` (``ModelConfig`` or the engine reads it and computes as transformers does),
``NO_EFFECT`` at inference (with the reason), or ``REQUIRED``: served only at the values listed, the
model refused otherwise with the field named. tests/models/test_config_fields.py walks
transformers' config classes for the families in ``SUPPORTED_ARCHITECTURES`` and fails on a field
this table does not list, so a new transformers field is decided here before it can be ignored.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ModelLoadError

HONOURED: dict[str, str] = {
    "vocab_size": "embedding and LM head rows",
    "hidden_size": "the residual stream",
    "intermediate_size": "the MLP's width",
    "num_hidden_layers": "the layers",
    "num_attention_heads": "query heads",
    "num_key_value_heads": "KV heads (grouped-query attention)",
    "head_dim": "per-head width where it is not hidden_size / heads",
    "rms_norm_eps": "every RMSNorm",
    "max_position_embeddings": "the rope table and the longest sequence",
    "tie_word_embeddings": "the LM head is the embedding",
    "rope_parameters": "kvmesh.engine.rope: default, linear, llama3 and yarn; other types and partial rotary refused",
    "rope_theta": "the rope base (configs written before rope_parameters)",
    "rope_scaling": "the rope scaling (configs written before rope_parameters)",
    "sliding_window": "each sliding layer's window (ModelConfig.layer_windows)",
    "use_sliding_window": "whether Qwen2/Qwen3 layers slide",
    "max_window_layers": "the first sliding layer of Qwen2/Qwen3 configs without layer_types",
    "layer_types": "full_attention and sliding_attention layers; other types refused",
    "dtype": "the checkpoint's dtype, served unless --dtype says otherwise",
    "torch_dtype": "dtype's name before transformers 4.56",
    "quantization_config": "kvmesh.checkpoint.formats: the formats it names; others refused there",
    "eos_token_id": "where generation stops",
    "query_pre_attn_scalar": "Gemma's attention scale, its -1/2 power",
    "final_logit_softcapping": "Gemma's tanh cap on the logits",
    "rope_local_base_freq": "Gemma 3's rope base of sliding layers (configs before rope_parameters)",
    "sliding_window_pattern": "Gemma 3's every n-th layer global (configs before layer_types)",
    "_sliding_window_pattern": "the same, as transformers 5 writes it",
    "num_experts": "Qwen3-MoE's routed experts (kvmesh.checkpoint.moe_config)",
    "num_local_experts": "Mixtral's routed experts (and Qwen3-MoE's, as transformers 5 saves them)",
    "num_experts_per_tok": "the experts each token is routed to",
    "moe_intermediate_size": "each routed expert's MLP width",
    "norm_topk_prob": "whether the chosen experts' weights are renormalised",
    "decoder_sparse_step": "Qwen3-MoE: every n-th layer is sparse",
    "mlp_only_layers": "Qwen3-MoE: layers with a dense MLP",
    "n_routed_experts": "DeepSeek-V3's routed experts",
    "n_shared_experts": "DeepSeek-V3's shared experts, every token through them",
    "n_group": "DeepSeek-V3: expert groups a token's choice is limited by",
    "topk_group": "DeepSeek-V3: the groups a token picks its experts from",
    "routed_scaling_factor": "DeepSeek-V3: the chosen experts' weights' factor",
    "first_k_dense_replace": "DeepSeek-V3: the first layers' dense MLPs",
    "moe_layer_freq": "DeepSeek-V3: every n-th layer from first_k_dense_replace is sparse",
    "scoring_func": "DeepSeek's router scores: sigmoid served, others refused (moe_config)",
    "topk_method": "DeepSeek's expert choice: noaux_tc served, others refused (moe_config)",
    "q_lora_rank": "MLA: the query's low-rank bottleneck (kvmesh.checkpoint.mla_config)",
    "kv_lora_rank": "MLA: the latent's width, what the KV pool holds",
    "qk_nope_head_dim": "MLA: each head's key width without rotary position",
    "qk_rope_head_dim": "MLA: the rotated key part shared by every head",
    "v_head_dim": "MLA: each head's value width",
    "rope_interleave": "MLA: rotary dimensions in interleaved pairs",
}

NO_EFFECT: dict[str, str] = {
    "attention_dropout": "dropout is off at inference",
    "resid_pdrop": "dropout is off at inference",
    "embd_pdrop": "dropout is off at inference",
    "original_max_position_embeddings": "read only by longrope scaling, which is refused (yarn reads its own)",
    "initializer_range": "random initialisation (training)",
    "use_cache": "transformers' own KV cache switch; kvmesh always pages its KV cache",
    "pretraining_tp": "transformers no longer reads it: the products are the same maths",
    "bos_token_id": "the tokenizer and chat template add it",
    "pad_token_id": "no padding: sequences are packed",
    "architectures": "read to pick the family",
    "model_type": "read to pick the family where architectures is absent",
    "chunk_size_feed_forward": "a memory trade-off of transformers' training code",
    "is_encoder_decoder": "false for every family served",
    "output_hidden_states": "transformers' output switch",
    "return_dict": "transformers' output switch",
    "problem_type": "classification heads only",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "transformers_version": "metadata",
    "router_aux_loss_coef": "the load-balancing loss (training)",
    "output_router_logits": "transformers' output switch (router logits feed the training loss)",
    "router_jitter_noise": "multiplicative noise on the router's input while training only",
    "num_mtp_layers": "multi-token prediction layers: the main model is served, their weights skipped",
    "num_nextn_predict_layers": "the same, as DeepSeek's own configs name it",
    "ep_size": "the expert-parallel degree DeepSeek trained at (--enable-expert-parallel chooses ours)",
    "aux_loss_alpha": "the load-balancing loss (training)",
    "seq_aux": "the load-balancing loss (training)",
}

# field -> (the values served, why others are not)
REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "Llama-family MLPs run SiLU-gated products"),
    "hidden_activation": (("gelu_pytorch_tanh",), "Gemma's MLP runs tanh-GELU-gated products"),
    "attn_logit_softcapping": ((None,), "soft-capped attention scores (Gemma 2) are not implemented"),
    "use_bidirectional_attention": ((False, None), "attention is causal"),
    "mlp_bias": ((False, None), "the MLP's projections have no bias here"),
    "attention_bias": ((False, None), "q/k/v/o biases as Llama writes them are not implemented (Qwen2's q/k/v are)"),
}


def check_fields(raw: dict[str, Any], source: str) -> None:
    """ModelLoadError naming the first field whose value kvmesh would compute differently from transformers."""
    for name, (served, why) in REQUIRED.items():
        if name in raw and raw[name] not in served:
            raise ModelLoadError(f"{source}: {name}={raw[name]!r} is not served ({why}); served: {list(served)}")


def decided(name: str) -> bool:
    """Whether the table says what happens to the field ``name``."""
    return name in HONOURED or name in NO_EFFECT or name in REQUIRED
