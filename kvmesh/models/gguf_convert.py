"""A llama-architecture GGUF file -> a standard Hugging Face model folder.

Read with ``gguf`` (llama.cpp's own reader): every tensor is dequantized with
``gguf.quants`` to float32, llama.cpp's Q/K row permutation is undone, names are
mapped to transformers', and the weights are written as bf16 safetensors. The
tokenizer.json is built from the GGUF's tokenizer metadata (a byte-level BPE:
vocab, merges, special tokens, and the pre-tokenizer its ``tokenizer.ggml.pre``
names), tokenizer_config.json carries the chat template kvmesh serves (ChatML
with tools, keeping the model's default system prompt), and config.json /
generation_config.json what transformers would write for the same model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvmesh.errors import ModelLoadError
from kvmesh.models.chatml import chatml_template

# GGUF tensor names (per block "blk.N.") -> transformers' names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# SmolLM2's template adds this system turn when a conversation has none.
_DEFAULT_SYSTEM = re.compile(r"'<\|im_start\|>system\n(.*?)<\|im_end\|>\n'", re.S)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf row permutation of q/k (interleaved -> halves RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hparams(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = f"{arch}."
    h = {
        "hidden_size": int(_field(reader, p + "embedding_length")),
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": int(_field(reader, p + "attention.head_count")),
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv")),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        # GGUF stores float32: keep the shortest decimal that rounds to it (1e-05, not 9.99999974e-06).
        "rms_norm_eps": float(str(np.float32(_field(reader, p + "attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
    }
    h["head_dim"] = int(_field(reader, p + "rope.dimension_count", h["hidden_size"] // h["num_attention_heads"]))
    if _field(reader, p + "rope.scaling.type") not in (None, "none"):
        raise ModelLoadError("GGUF RoPE scaling is not converted yet")
    return h


def convert_weights(reader: Any, hparams: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantized, un-permuted and renamed, as bf16."""
    import gguf.quants

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            if m is None or m.group(2) not in _BLOCK_NAMES:
                raise ModelLoadError(f"GGUF tensor {t.name!r} has no transformers name")
            name = f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, hparams["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, hparams["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, order="C")).to(
            torch.bfloat16
        )  # a copy: the reader's memory is read-only
    return out


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` (llama-vocab.cpp's regexes)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "smollm":  # \p{N} alone first: every digit is its own token, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported (gpt2, smollm)")


def build_tokenizer(reader: Any) -> Tokenizer:
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError("only byte-level BPE GGUF tokenizers (tokenizer.ggml.model = gpt2) are supported")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(t, special=ty == _CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)  # ids stay those of the vocab: every added token is already in it
    return tok


def _chat_template(source: str) -> str:
    """Ours (ChatML that renders tools) for a ChatML model, keeping its default system prompt;
    any other model keeps its own template."""
    if "<|im_start|>" not in source:
        return source
    default_system = _DEFAULT_SYSTEM.search(source)
    return chatml_template(default_system.group(1) if default_system else None)


def _token(tokens: list[str], reader: Any, key: str) -> str | None:
    i = _field(reader, key)
    return tokens[int(i)] if i is not None else None


def convert(gguf_path: Path, out: Path, extra_config: dict[str, Any] | None = None) -> None:
    """Write the Hugging Face folder for ``gguf_path`` into ``out`` (created)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    hp = _hparams(reader)
    tensors = convert_weights(reader, hp)
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    tied = "lm_head.weight" not in tensors
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        **hp,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
        **(extra_config or {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        k: v for k, v in {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}.items() if v is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    source_template = _field(reader, "tokenizer.chat_template") or ""
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": _token(tokens, reader, "tokenizer.ggml.bos_token_id"),
                "eos_token": _token(tokens, reader, "tokenizer.ggml.eos_token_id"),
                "pad_token": _token(tokens, reader, "tokenizer.ggml.padding_token_id"),
                "unk_token": _token(tokens, reader, "tokenizer.ggml.unknown_token_id"),
                "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                "chat_template": _chat_template(source_template),
                "model_max_length": hp["max_position_embeddings"],
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
