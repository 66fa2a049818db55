"""The model runner: the model on its device, its paged KV pool, and one batched forward pass.

``ModelRunner`` loads a checkpoint (quantized or not) into its family's model (``kvmesh.engine.families``),
allocates the KV pool, compiles the decode step when asked, and for each scheduled batch lays out the
inputs (token ids, positions, KV slots, block tables), runs the forward and returns the logits of the rows
that sample, with each request's logit adjustments (bias, penalties) and grammar masks applied. The
engine (``kvmesh.engine.engine``) decides what runs; this file only runs it.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvmesh.blocks import model_fingerprint
from kvmesh.checkpoint.compressed import checkpoint_tensors
from kvmesh.checkpoint.files import weight_files, weights_id
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.compile import compile_decode
from kvmesh.engine.config import EngineConfig, dtype_name
from kvmesh.engine.families import model_class
from kvmesh.engine.grammar import MaskRows, Masks
from kvmesh.engine.kv_cache import KVCache
from kvmesh.engine.lora import LoraAdapters
from kvmesh.engine.penalties import PenaltyState, adjust_row
from kvmesh.engine.scheduler import ScheduledBatch
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.sharded_kv import ShardedKVCache
from kvmesh.engine.step_metadata import step_metadata
from kvmesh.engine.system_fingerprint import system_fingerprint
from kvmesh.engine.tensor_parallel import TensorParallelGroup, rank_device
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from kvmesh.engine.draft_source import DraftSource
    from kvmesh.engine.outputs import EngineStats


class ModelRunner:
    def __init__(
        self,
        path: Path,
        cfg: EngineConfig,
        mc: ModelConfig,
        drafter: DraftSource | None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``eos_token_ids``: the tokens that end a sequence, which a request's min_tokens masks early."""
        self.config = cfg
        self.eos_token_ids = eos_token_ids
        self.vocab_size = mc.vocab_size
        self.device = torch.device(cfg.device)
        self.dtype = cfg.resolve_dtype(mc.dtype)
        self.max_model_len = cfg.resolve_max_model_len(mc.max_position_embeddings)
        files = weight_files(path)
        self.tp, layouts = self._start_tensor_parallel(path, cfg, mc)
        layout = layouts[0] if layouts else None  # this rank's
        self.model = model_class(mc)(
            mc, self.dtype, self.device, self.max_model_len, layout, self.tp.link.model_all_reduce if self.tp else None
        )
        # A compressed-tensors checkpoint (kvmesh quantize) is dequantized on load.
        self.model.load_weights(partial(checkpoint_tensors, mc.raw, files))
        self.model.to(self.device).eval()
        if cfg.deterministic:
            if cfg.quantization is not None:
                raise InvalidArgument("deterministic serving does not run quantized weights yet")
            self.model.make_batch_invariant()  # FailedPrecondition where its kernels cannot run
        if cfg.quantization is not None:
            # Before the KV pool is allocated, so the freed weight memory can go to it.
            # InvalidArgument for an unknown scheme; FailedPrecondition where it cannot run.
            self.model.quantize(cfg.quantization, head=cfg.quantize_lm_head)
        elif cfg.quantize_lm_head:
            raise InvalidArgument("quantize_lm_head needs a quantization (fp8 or int8)")
        if cfg.wants_small_rows_linears(self.dtype):
            # Decode and verify steps multiply a few rows, where MKL repacks every weight per call
            # (or, on some processors, runs one row at half memory speed); a reordered copy of the
            # weights avoids that (kernels.small_rows_linear, which says where and by how much).
            self.model.use_small_rows_linears()
        self.fingerprint = model_fingerprint(
            # Quantized weights give different KV: such workers must never share blocks with others.
            {
                **mc.raw,
                "weights_id": weights_id(files),
                "quantization": cfg.quantization,
                **({"quantize_lm_head": True} if cfg.quantize_lm_head else {}),
                # Its KV rounds differently: a deterministic worker reuses only deterministic blocks, and
                # only those of its own tensor-parallel degree (the all-reduces sum in another order).
                **(
                    {"batch_invariant": True, "tensor_parallel_size": cfg.tensor_parallel_size}
                    if cfg.deterministic
                    else {}
                ),
            },
            dtype_name(self.dtype),
            cfg.block_size,
        )
        self.system_fingerprint = system_fingerprint(
            self.fingerprint, self.device, cfg.tensor_parallel_size, cfg.expert_parallel and mc.moe is not None
        )
        # Adapters loaded later find the model ready for them: nothing is allocated until one is.
        self.lora = None
        if cfg.max_loras > 0:
            self.lora = LoraAdapters(
                mc,
                self.dtype,
                self.device,
                cfg.max_loras,
                cfg.max_lora_rank,
                self.fingerprint,
                layouts,
                self.tp.send_lora_slot if self.tp else None,
            )
            self.model.use_lora(self.lora)
        self.wants_features = drafter is not None and drafter.wants_features
        if drafter is not None:
            # Before the decode step is compiled: the features it returns are traced with it.
            drafter.bind(self.model)
            self.model.feature_layers = drafter.feature_layers
        kv_heads = layout.local_kv_heads if layout is not None else mc.num_kv_heads
        self.kv: KVCache | ShardedKVCache = KVCache(
            mc.num_layers,
            cfg.num_blocks,
            cfg.block_size,
            kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            mc.kv_components,
        )
        if self.tp is not None:
            self.kv = ShardedKVCache(self.kv, self.tp, layouts, mc.num_kv_heads)  # blocks move whole
            self.tp.wait_ready()
        if cfg.compiles():  # before any block holds KV
            settings = self._compile_settings()
            if self.tp is None:
                compile_decode(self.model, self.kv.tensor, settings)
            else:  # every rank its own graphs, at once; before mirroring: each warms up alone
                self.tp.compile_decode(settings, partial(compile_decode, self.model, self.kv.tensor, settings, False))
        if self.tp is not None:
            self.model.mirror = self.tp.mirror  # before the drafter's calibration: its probe steps run on every rank
        if drafter is not None:
            drafter.calibrate(self.model, self.kv.tensor, self.max_model_len)  # likewise

    def _start_tensor_parallel(
        self, path: Path, cfg: EngineConfig, mc: ModelConfig
    ) -> tuple[TensorParallelGroup | None, list[TPLayout] | None]:
        """With ``tensor_parallel_size`` > 1, the other ranks started (loading meanwhile) and every rank's slice,
        this one's first; InvalidArgument or FailedPrecondition, before anything starts, for what ranks cannot
        serve yet."""
        size = cfg.tensor_parallel_size
        if size == 1:
            return None, None
        layouts = [
            TPLayout.of(mc, r, size, cfg.expert_parallel) for r in range(size)
        ]  # InvalidArgument where the config cannot be split
        cfg.resolve_tp_all_reduce()  # InvalidArgument where the device cannot use the one asked for
        if self.device.type == "cuda":
            first, last = rank_device(cfg.device, 0).index, rank_device(cfg.device, size - 1).index
            if last >= torch.cuda.device_count():
                raise FailedPrecondition(
                    f"tensor parallelism of {size} on {cfg.device} runs on GPUs cuda:{first} to cuda:{last}; "
                    f"this machine has {torch.cuda.device_count()}"
                )
        elif self.device.type != "cpu":
            raise FailedPrecondition(f"tensor parallelism runs on CPU or CUDA ranks, not {self.device.type}")
        self._threads_before = torch.get_num_threads()
        threads = max(1, self._threads_before // size)
        torch.set_num_threads(threads)  # this process is rank 0: one share of the cores (until close)
        return TensorParallelGroup.start(path, cfg, threads), layouts

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None
            torch.set_num_threads(self._threads_before)

    def _compile_settings(self) -> dict[str, object]:
        """What, beside the toolchain, a compiled decode graph of this runner depends on
        (``kvmesh.engine.compile_cache``): the model's fingerprint names weights, dtype, block size
        and quantization; the rest are shapes and flags that change the traced code."""
        cfg = self.config
        return {
            "model": self.fingerprint,
            "device": str(self.device),
            "kv_pool": list(self.kv.tensor.shape),  # a follower's is its own (tensor_parallel.py)
            "tensor_parallel": [0, cfg.tensor_parallel_size],  # rank 0's graphs; a follower's name its rank
            "threads": torch.get_num_threads(),  # inductor writes it into the kernels it compiles
            "max_model_len": self.max_model_len,
            "small_rows_linears": cfg.small_rows_linears,
            "max_loras": cfg.max_loras,
            "max_lora_rank": cfg.max_lora_rank,
            "feature_layers": list(self.model.feature_layers),
        }

    def forward(
        self, batch: ScheduledBatch, stats: EngineStats
    ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
        """One forward pass over ``batch``: (the sequences whose rows sample, in row order; their logits
        [rows, vocab] on the CPU; the hidden states of those rows, when the drafter reads features)."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens = []
        logits_idx: list[int] = []
        sampling = []
        for seq, n in zip(batch.seqs, batch.num_new):
            a, b = seq.num_computed, seq.num_computed + n
            ids.extend((seq.all_ids + seq.draft_ids)[a:b])
            positions.extend(range(a, b))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(a, b))
            starts.append(starts[-1] + n)
            seq_lens.append(b)
            k = len(seq.draft_ids)
            if b == seq.num_tokens + k:  # the whole context is in cache: these rows sample
                logits_idx.extend(range(starts[-1] - 1 - k, starts[-1]))
                sampling.append(seq)
        # At least 2 columns (padding is masked by seq_lens): a width of 1 would be one more
        # shape for a compiled step to specialize on (kvmesh.engine.compile).
        max_blocks = max(2, max(len(s.block_table) for s in batch.seqs))
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = step_metadata(slots, tables, seq_lens, batch.num_new, dev, every_row_samples=len(logits_idx) == len(ids))
        if self.lora is not None:
            self.lora.bind_step([(s.lora_slot, n) for s, n in zip(batch.seqs, batch.num_new)], dev)
        try:
            out = self.model(
                torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                self.kv.tensor,
                meta,
                torch.tensor(logits_idx, dtype=torch.long, device=dev),
                return_hidden=self.wants_features,
            )
        finally:
            if self.lora is not None:
                self.lora.unbind_step()
        logits, hidden = out if self.wants_features else (out, None)
        self._adjust_logits(sampling, logits)
        # Launched (on a GPU still running): fill the grammar masks meanwhile, apply them on the
        # device, and only then wait for the logits.
        t0 = time.perf_counter()
        masks = self._grammar_masks(sampling, len(logits_idx))
        if masks is not None:
            stats.grammar_masked_rows += masks.apply(logits)
            stats.grammar_mask_seconds += time.perf_counter() - t0
        return sampling, logits.cpu(), hidden

    @torch.inference_mode()  # the logits are inference tensors: adjusting them in place needs it
    def _adjust_logits(self, sampling: list[Sequence], logits: torch.Tensor) -> None:
        """logit_bias and penalties on the rows of the sequences that ask for them (in place). A
        sequence whose adjustment fails keeps the error (``seq.error``): the engine fails it alone."""
        row = 0
        for seq in sampling:
            k = len(seq.draft_ids)
            if seq.params.adjusts_logits:
                try:
                    if seq.penalties is None:
                        seq.penalties = PenaltyState.new(
                            seq.prompt_ids, seq.params, logits.shape[1], logits.device, self.eos_token_ids
                        )
                    seq.penalties.catch_up(seq.output_ids)
                    for i in range(k + 1):
                        adjust_row(logits[row + i], seq.params, seq.penalties, seq.draft_ids[:i])
                except Exception as e:
                    seq.error = e
            row += k + 1

    def _grammar_masks(self, sampling: list[Sequence], num_rows: int) -> Masks | None:
        """The grammar masks of the constrained sequences' rows (None if there are none); a sequence
        whose mask cannot be filled keeps the error, as in ``_adjust_logits``."""
        if not any(seq.grammar is not None and seq.error is None for seq in sampling):
            return None
        masks, row = Masks(num_rows, self.vocab_size), 0
        for seq in sampling:
            if seq.grammar is not None and seq.error is None:
                try:
                    masks.fill(MaskRows(seq.grammar, row, list(seq.draft_ids)))
                except Exception as e:
                    seq.error = e
            row += len(seq.draft_ids) + 1
        return masks
