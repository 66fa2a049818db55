"""The embedded default model, so ``kvmesh generate``/``kvmesh up`` work with no download.

The default is ``models/pycode-small`` in the repository: a small Python code
model trained on the standard library (``train/train_pycode.py``), found
relative to this package (installed editable from the repository root).

Where that folder is missing (e.g. a wheel install without ``models/``), the
fallback is a small Llama checkpoint with RANDOM weights, written once into a
cache folder as a standard Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template), by this code alone: no transformers at run time. Its output is
noise — say so wherever it is served.

The tokenizer is a byte-level BPE trained on Python source the interpreter
ships (the standard library), so any text round-trips and code tokenizes well.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

# <repo>/kvmesh/engine/default_model.py -> <repo>/models/pycode-small
SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "pycode-small"

RANDOM_MODEL_LABEL = "kvmesh-random-llama (RANDOM WEIGHTS: output is noise, for plumbing only)"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML. With ``tools`` (as transformers passes them), a system turn lists them as JSON inside
# <tools></tools> and asks for calls in the Hermes/Qwen format the gateway parses
# (services/gateway/tool_calls/hermes.py); the first system message's text leads that turn.
# Assistant calls are replayed in the same format, and tool results go back in a user turn as
# <tool_response> blocks (consecutive results share one turn). Without tools, ordinary messages
# render exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call these functions:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call one, write a block per call:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <arguments-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _stdlib_corpus(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(root.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(
    vocab_size: int = 1024, corpus_bytes: int = 2_000_000, texts: Iterable[str] | None = None
) -> Tokenizer:
    """A byte-level BPE tokenizer (lossless on any UTF-8) trained on stdlib Python source.

    ``texts`` replaces the default corpus (the stdlib's top-level modules, up to
    ``corpus_bytes``), e.g. a training split that leaves held-out files unseen.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(corpus_bytes) if texts is None else texts, trainer)
    return tok


def write_tokenizer(tok: Tokenizer, path: Path, model_max_length: int = 2048) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": model_max_length,
            },
            indent=2,
        )
    )


def write_random_llama(path: Path, vocab_size: int = 1024, hidden: int = 128, layers: int = 4, seed: int = 0) -> Path:
    """Write the random-weights default checkpoint to ``path``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    write_tokenizer(tok, path)
    eos = tok.token_to_id("<|endoftext|>")
    heads, kv_heads, inter = 4, 2, hidden * 3
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
        "bos_token_id": None,
        "torch_dtype": "float32",
        "kvmesh_label": RANDOM_MODEL_LABEL,
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    v = config["vocab_size"]
    tensors = {"model.embed_tokens.weight": rand(v, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def shipped_model_path() -> Path | None:
    """The trained model shipped in the repository, or None if this install lacks it."""
    return SHIPPED_MODEL_DIR if (SHIPPED_MODEL_DIR / "config.json").is_file() else None


def default_model_path() -> Path:
    """The default model's folder: the shipped model, else the random-weights one."""
    shipped = shipped_model_path()
    if shipped is not None:
        log.info("default model: %s (shipped, trained)", shipped)
        return shipped
    path = random_model_path()
    log.warning("default model: %s not found; using %s at %s", SHIPPED_MODEL_DIR, RANDOM_MODEL_LABEL, path)
    return path


def model_label(path: Path) -> str:
    """What a model folder says it is (config.json's ``kvmesh_label``), else its folder name."""
    try:
        return json.loads((path / "config.json").read_text()).get("kvmesh_label") or path.name
    except (OSError, json.JSONDecodeError):
        return path.name


def random_model_path() -> Path:
    """The random-weights model's folder, written on first use."""
    cache = Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh"))
    path = cache / "models" / "random-llama-v1"
    if not (path / "config.json").is_file():
        # Write aside and rename, so processes starting together never see half a folder.
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_random_llama(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its folder is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return path
