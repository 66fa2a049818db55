"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; sliding-window layers where the config
sets them) over a paged KV cache.

One forward pass takes a flat batch of new tokens from many sequences plus the
metadata that says where each sequence's K/V lives (``AttentionMetadata``).
Every op goes through ``kernels.dispatch``; attention reads K/V through block
tables, never a contiguous copy of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import Ops
from kernels.errors import KernelUnavailable, UnknownScheme
from kernels.invariant_linear import InvariantLinear, use_invariant_linears
from kernels.quantized_linear import QuantizedLinear, get_scheme, quantize_model
from kernels.small_rows_linear import SmallRowsLinear, use_small_rows_linears
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.lora import LoraSlots
from kvmesh.engine.rope import rope_cos_sin_cache
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition, InvalidArgument, ModelLoadError


@dataclass
class AttentionMetadata:
    """Where the batch's tokens go and what they attend to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B] tokens in cache after this step (prefix + new)
    query_start_loc: torch.Tensor  # [B+1] offsets of each sequence's new tokens in the batch
    is_decode: bool  # every row attends as a decode: one row a sequence (kvmesh.engine.step_metadata)


def write_layer_kv(
    ops: Ops, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """This step's K/V into layer ``layer`` of the pool ``[layers, 2, blocks, block_size, Hk, D]`` (MLA's
    latent pool ``[layers, 1, ...]`` holds no V: its attention passes the latent as both)."""
    ops.write_kv_cache(k, v, kv_cache[layer, 0], kv_cache[layer, -1], slot_mapping)


# The config's activation (``ModelConfig.hidden_act``) -> the op of ``kernels.Ops`` that gates the MLP with it.
GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index  # which layer of the KV pool is this one's
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]
        # Sliding-window attention: the last ``window`` tokens only, this token included (0: all of them).
        self.window = cfg.layer_windows[index] if cfg.layer_windows else 0
        h = cfg.hidden_size
        self.init_attention(cfg, dtype)
        if self.has_dense_mlp(cfg, index):
            self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
            self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False, dtype=dtype)
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.post_attn_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        # The engine's LoRA adapters (kvmesh.engine.lora), shared by every layer; None: LoRA off.
        self.lora: LoraSlots | None = None
        # Tensor parallelism (kvmesh.engine.tensor_parallel): sums the ranks' partial o_proj and
        # down_proj products in place; None: one rank holds the whole layer.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def init_attention(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        """The attention's weights: fused q/k/v, the output projection, the QK norms where the family has them."""
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, h, bias=False, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype))

    def has_dense_mlp(self, cfg: ModelConfig, index: int) -> bool:
        """Whether layer ``index``'s MLP is the dense gated one (a Mixture-of-Experts layer's is not)."""
        return True

    def _project(self, ops: Ops, name: str, x: torch.Tensor) -> torch.Tensor:
        """The projection ``name`` of ``x``, plus each token's LoRA adapter product."""
        y = getattr(self, name)(x)
        if self.lora is not None:
            self.lora.add(ops, self.index, name, x, y)
        return y

    def forward(
        self,
        ops: Ops,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        write_kv=write_layer_kv,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.join_and_norm(ops, hidden, residual)
        hidden = self.attention(ops, positions, hidden, kv_cache, cos_sin, meta, write_kv)
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attn_norm, self.cfg.rms_norm_eps)
        return self.mlp(ops, hidden), residual

    def join_and_norm(
        self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's normed input, the residual stream): the previous layer's output joins the stream
        here (the first layer's input starts it)."""
        if residual is None:
            return ops.rms_norm(hidden, self.input_norm, self.cfg.rms_norm_eps), hidden
        return ops.fused_add_rms_norm(hidden, residual, self.input_norm, self.cfg.rms_norm_eps)

    def attention(
        self,
        ops: Ops,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        write_kv=write_layer_kv,
    ) -> torch.Tensor:
        """The attention block on the normed ``hidden``: its output projection, summed over the ranks."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        t = hidden.shape[0]
        q, k, v = self._project(ops, "qkv_proj", hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, eps)
            k = ops.rms_norm(k, self.k_norm, eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        write_kv(ops, k, v, kv_cache, self.index, meta.slot_mapping)
        k_cache, v_cache = kv_cache[self.index, 0], kv_cache[self.index, 1]
        scale = cfg.attn_scale
        if meta.is_decode:
            attn = ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, self.window)
        else:
            attn = ops.paged_extend_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, self.window
            )
        hidden = self._project(ops, "o_proj", attn.reshape(t, -1))
        if self.all_reduce is not None:
            self.all_reduce(hidden)
        return hidden

    def mlp(self, ops: Ops, hidden: torch.Tensor) -> torch.Tensor:
        """The gated MLP on the normed ``hidden``, summed over the ranks."""
        gated = getattr(ops, self.act)(self._project(ops, "gate_up_proj", hidden))
        hidden = self._project(ops, "down_proj", gated)
        if self.all_reduce is not None:
            self.all_reduce(hidden)
        return hidden


class CausalLM(nn.Module):
    LAYER: type[DecoderLayer] = DecoderLayer  # a family's own layer (kvmesh.engine.families)
    # HF module name -> ours, for the tensors that are not fused (norm weights are bare parameters here).
    RENAMED = {
        "self_attn.o_proj": "o_proj",
        "mlp.down_proj": "down_proj",
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_attn_norm",
        "self_attn.q_norm": "q_norm",
        "self_attn.k_norm": "k_norm",
    }

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        tp: TPLayout | None = None,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``tp``: the slice of every layer and the vocabulary rows of the embedding and head this
        tensor-parallel rank holds, ``all_reduce`` summing the ranks' partial products
        (kvmesh.engine.tensor_parallel); None: the whole model."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # What each layer holds: its heads, KV heads and intermediate columns under tensor parallelism.
        self.layer_cfg = tp.local_config(cfg) if tp is not None else cfg
        self.ops = Ops(device)
        # Vocab-parallel embedding and LM head: the (first, count) vocabulary rows of both this rank holds.
        # Every rank looks up the tokens in its rows and computes their logits; an all-reduce adds the
        # ranks' parts up. None: all rows.
        self.head_rows = tp.vocab_range(cfg.vocab_size) if tp is not None and tp.size > 1 else None
        rows = cfg.vocab_size if self.head_rows is None else self.head_rows[1]
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self.LAYER(self.layer_cfg, dtype, i) for i in range(cfg.num_layers))
        for layer in self.layers:
            layer.all_reduce = all_reduce
        self.all_reduce = all_reduce
        # Rank 0 of a tensor-parallel group: sends each forward pass's inputs to the other ranks
        # before running it (TensorParallelGroup.mirror); None: no other ranks.
        self.mirror: Callable[[tuple], None] | None = None
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False, dtype=dtype)
        # What reads the whole vocabulary's embedding and head on a rank that holds a part (an EAGLE
        # head, its fingerprint): the checkpoint's HF-named tensors, read again (``load_weights`` sets it).
        self._checkpoint: Callable[..., Iterable[tuple[str, torch.Tensor]]] | None = None
        cos_sin = rope_cos_sin_cache(cfg.rope, self.rope_dim(cfg), max_positions, cfg.max_position_embeddings)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        # ``run`` compiled for decode steps, and the KV write it traces (kvmesh.engine.compile);
        # None / the plain op: eager everywhere.
        self.compiled_decode = None
        self.write_kv = write_layer_kv
        # The LM head as a module of its own kind (``use_small_rows_linears``); None: a plain product.
        self.head_proj: nn.Module | None = None
        # Layers (ascending) whose outputs (the residual stream after them), concatenated, are the
        # feature ``forward(return_hidden=True)`` returns (an EAGLE-3 style draft head's input);
        # empty: the final hidden state. Set before the decode step is compiled: a graph keeps what
        # it traced.
        self.feature_layers: tuple[int, ...] = ()
        self.lora: LoraSlots | None = None

    def rope_dim(self, cfg: ModelConfig) -> int:
        """The width the rotary embedding turns: every head dimension here (MLA's decoupled part there)."""
        return cfg.head_dim

    def use_lora(self, lora: LoraSlots) -> None:
        """Add each token's adapter product after every projection (steps that bind no adapter run as before)."""
        self.lora = lora
        for layer in self.layers:
            layer.lora = lora

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns float32 logits [len(logits_indices), vocab] for the rows that sample.

        With ``return_hidden``, returns ``(logits, features)``: also those rows' features, the
        input an EAGLE head drafts from: the final hidden states (after the last norm, the LM
        head's input), or with ``feature_layers`` the outputs of those layers, concatenated.
        """
        if self.mirror is not None:
            binding = self.lora.binding() if self.lora is not None else None
            self.mirror((input_ids, positions, meta, binding, logits_indices))
        logits, hidden = self.step(input_ids, positions, kv_cache, meta, logits_indices)
        return (logits, hidden) if return_hidden else logits

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run``, through the compiled decode graphs where the step is a decode and they exist: on rank 0
        (``forward``) and on every other tensor-parallel rank alike."""
        # A compiled decode step traced the base model only: a step that binds adapters runs eagerly.
        adapted = self.lora is not None and self.lora.segments is not None
        run = self.compiled_decode if meta.is_decode and self.compiled_decode is not None and not adapted else self.run
        return run(input_ids, positions, kv_cache, meta, logits_indices)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The body and the LM head on the rows that sample: (float32 logits, their features)."""
        hidden, taps = self.body(input_ids, positions, kv_cache, meta)
        hidden = hidden[logits_indices]
        features = torch.cat([t[logits_indices] for t in taps], dim=-1) if taps else hidden
        if self.head_proj is not None:
            logits = self.head_proj(hidden).float()
        else:
            logits = torch.matmul(hidden, self.head_weight.t()).float()
        return self._gather_vocab(logits), features

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden]. Split over ranks, each looks up the tokens in its own rows,
        zeros for the others, and the all-reduce adds them up: exact, as one rank's row plus zeros."""
        if self.head_rows is None:
            return self.embed_tokens(input_ids)
        first, count = self.head_rows
        if count == 0:  # more ranks than ceil(V/N) shares: this one holds no row
            hidden = self.embed_tokens.weight.new_zeros((input_ids.shape[0], self.cfg.hidden_size))
        else:
            local = input_ids - first
            outside = (local < 0) | (local >= count)
            hidden = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0)
        self.all_reduce(hidden)
        return hidden

    def _gather_vocab(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's logits [rows, vocab] from each rank's ``head_rows`` columns: each writes its own into
        zeros and the all-reduce adds them up, which is exact (x + 0 is x), so every rank ends with the bits
        one whole head would give it."""
        if self.head_rows is None or part.shape[0] == 0:  # no row samples: on every rank alike
            return part if self.head_rows is None else part.new_zeros((0, self.cfg.vocab_size))
        first, count = self.head_rows
        whole = part.new_zeros((part.shape[0], self.cfg.vocab_size))
        whole[:, first : first + count] = part
        self.all_reduce(whole)
        return whole

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [rows, hidden] as loaded, this rank's ``head_rows`` (all of them on one
        rank): the embedding's when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def whole_vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding, LM head) over the whole vocabulary, [vocab, hidden] each: this model's own on one
        rank; on a rank that holds a part, the checkpoint's read again (on this model's device and dtype),
        which is what a draft head drafting over every token needs."""
        if self.head_rows is None:
            return self.embed_tokens.weight, self.head_weight
        if self._checkpoint is None:
            raise FailedPrecondition("the whole vocabulary's weights are read from the checkpoint: load it first")
        names = ("model.embed_tokens.weight",) + (() if self.lm_head is None else ("lm_head.weight",))
        like = self.embed_tokens.weight
        read = {name: t.to(like.device, like.dtype) for name, t in self._checkpoint(names)}
        embedding = read["model.embed_tokens.weight"]
        return embedding, read.get("lm_head.weight", embedding)

    def quantize(self, scheme: str, head: bool = False) -> None:
        """8-bit weights for every projection (``kernels.quantized_linear``), and with ``head``
        for the LM head's product too. The embedding lookup keeps the checkpoint's weights (a
        tied head's 8-bit copy is the head's own), so a draft head trained on this target still
        recognises it (kvmesh.speculation.eagle.target_fingerprint). InvalidArgument for an unknown
        scheme, FailedPrecondition (before any weight is touched) where it cannot run."""
        try:
            quantize_model(self, scheme)  # the projections; "lm_head" is skipped
            if head:
                bias = None if self.lm_head is None else self.lm_head.bias
                self.head_proj = QuantizedLinear(self.head_weight, bias, get_scheme(scheme))
        except UnknownScheme as e:
            raise InvalidArgument(str(e)) from None
        except KernelUnavailable as e:
            raise FailedPrecondition(str(e)) from None

    def use_small_rows_linears(self) -> None:
        """Run few-row products (decode steps, a speculative verify's k+1 rows) on oneDNN-reordered weights,
        the LM head's included unless it is quantized (``kernels.small_rows_linear``; CPU). The
        weights must not change afterwards: the reordered copies would not follow."""
        if self.head_proj is None and self.lm_head is None:  # tied: the embedding's rows
            self.head_proj = SmallRowsLinear(self.head_weight, None)
        # After the head's module exists: the float32 row floor is calibrated for every one.
        use_small_rows_linears(self)
        if self.head_proj is None:
            self.head_proj = self.lm_head

    def make_batch_invariant(self) -> None:
        """Run every op in a form whose result for a token does not depend on the rows it is batched
        with (``kernels.invariant_linear``, ``Ops(batch_invariant=True)``): deterministic serving.
        FailedPrecondition (saying why) where those kernels cannot run."""
        try:
            self.ops = Ops(self.embed_tokens.weight.device, batch_invariant=True)
            use_invariant_linears(self, self.ops.invariant_mm)  # the projections and an untied LM head
            tied = self.lm_head is None  # the embedding's rows: no module of its own to swap
            mm = self.ops.invariant_mm
            self.head_proj = InvariantLinear(self.head_weight, None, mm) if tied else self.lm_head
        except KernelUnavailable as e:
            raise FailedPrecondition(f"deterministic serving: {e}") from None

    def body(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embedding, every layer (writing this step's K/V) and the final norm: (hidden [T, hidden],
        the residual stream [T, hidden] after each of ``feature_layers``, in layer order)."""
        hidden = self.embed(input_ids)
        residual = None
        taps = []
        for layer in self.layers:
            cos_sin = self.cos_sin_of(layer)
            hidden, residual = layer(self.ops, positions, hidden, residual, kv_cache, cos_sin, meta, self.write_kv)
            if layer.index in self.feature_layers:
                taps.append(hidden + residual)
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        return hidden, taps

    def cos_sin_of(self, layer: DecoderLayer) -> torch.Tensor:
        """The rope table ``layer`` rotates by: one for every layer here (a family may keep one per layer kind)."""
        return self.cos_sin

    def load_weights(self, checkpoint: Callable[..., Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Copy the HF-named tensors ``checkpoint()`` yields into this model, fusing q/k/v and gate/up
        projections (``kvmesh.checkpoint.compressed.checkpoint_tensors``: dequantized where quantized;
        ``checkpoint(names)`` yields only those, read again by ``whole_vocab_weights``)."""
        self._checkpoint = checkpoint
        cfg = self.layer_cfg  # a tensor-parallel rank's fused projections hold its slices (``TPLayout.shard``)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused = self.fused_names(cfg)
        renamed = self.RENAMED
        for name, tensor in checkpoint():
            target, rows = self._map_name(name, fused, renamed)
            if target is None:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            if target not in params:
                raise ModelLoadError(f"weight {name!r} has no place in {cfg.architecture}")
            param = params[target]
            if self.tp is not None:
                tensor = self.tp.shard(name, tensor)
            dst = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
            if dst.shape != tensor.shape:
                raise ModelLoadError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            loaded.add(name)
        missing = self._expected_names(fused, renamed) - loaded
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:5])}")

    def fused_names(self, cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
        """HF module suffix -> (our fused projection, row offset, rows): q/k/v and gate/up."""
        qs, ks = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {
            "self_attn.q_proj": ("qkv_proj", 0, qs),
            "self_attn.k_proj": ("qkv_proj", qs, ks),
            "self_attn.v_proj": ("qkv_proj", qs + ks, ks),
            "mlp.gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "mlp.up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }

    def _map_name(self, name: str, fused: dict, renamed: dict) -> tuple[str | None, tuple[int, int] | None]:
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if name == "model.norm.weight":
            return "norm", None
        if name == "lm_head.weight":
            # Some tied checkpoints still store lm_head; the embedding is the source of truth then.
            return (None, None) if self.lm_head is None else ("lm_head.weight", None)
        if not name.startswith("model.layers.") or "rotary_emb" in name:
            return None, None
        idx, rest = name[len("model.layers.") :].split(".", 1)
        module, kind = rest.rsplit(".", 1)  # kind: weight | bias
        if module in fused:
            ours, off, rows = fused[module]
            return f"layers.{idx}.{ours}.{kind}", (off, rows)
        if module in renamed:
            ours = renamed[module]
            # Norm weights are bare parameters here; projections keep their .weight suffix.
            return (f"layers.{idx}.{ours}" if "norm" in module else f"layers.{idx}.{ours}.{kind}"), None
        return f"layers.{idx}.{module}.{kind}", None

    def _expected_names(self, fused: dict, renamed: dict) -> set[str]:
        cfg = self.cfg
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names |= {p + m + ".weight" for m in fused}
            names |= {p + m + ".weight" for m in renamed if cfg.qk_norm or "q_norm" not in m and "k_norm" not in m}
            if cfg.qkv_bias:
                names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        return names
