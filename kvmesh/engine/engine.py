"""The engine: requests in, tokens out, one batched forward pass per step.

Single-threaded by design: a service runs ``step()`` in its own thread and
talks to it through queues (``kvmesh.engine.async_engine``), so a forward pass
never blocks the event loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmesh.blocks import BlockHash, block_hashes, model_fingerprint
from kvmesh.engine.block_manager import BlockEventSink, BlockManager
from kvmesh.engine.config import EngineConfig, ModelConfig, dtype_name
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.kv_cache import KV_LAYOUT, BlockPayload, KVCache
from kvmesh.engine.model import AttentionMetadata, CausalLM
from kvmesh.engine.sampler import sample
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import ScheduledBatch, Scheduler
from kvmesh.engine.sequence import Sequence, TokenLogprob
from kvmesh.engine.stop import check_stop, releasable_text
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.engine.weights import weight_files, weights_id
from kvmesh.errors import InvalidArgument, NotFound


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[TokenLogprob]
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # of which served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    generated_tokens: int = 0
    imported_blocks: int = 0
    exported_blocks: int = 0
    preemptions: int = 0


@dataclass
class Completion:
    """A finished request, as ``generate`` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLMEngine:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, on_block_event: BlockEventSink | None = None):
        self.config = cfg = config or EngineConfig()
        path = Path(model_path)
        if not path.is_dir():
            raise InvalidArgument(f"model path {path} is not a directory")
        self.model_config = mc = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        self.device = torch.device(cfg.device)
        self.dtype = cfg.resolve_dtype(mc.dtype)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        files = weight_files(path)
        self.model = CausalLM(mc, self.dtype, self.device, self.max_model_len)
        self.model.load_weights(files)
        self.model.to(self.device).eval()
        self.fingerprint = model_fingerprint(
            {**mc.raw, "weights_id": weights_id(files)}, dtype_name(self.dtype), cfg.block_size
        )
        self.kv = KVCache(
            mc.num_layers, cfg.num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        self.blocks = BlockManager(cfg.num_blocks, cfg.enable_prefix_cache, on_block_event)
        self.scheduler = Scheduler(
            self.blocks, cfg.block_size, self.fingerprint, cfg.max_num_seqs, cfg.max_num_batched_tokens
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._default_gen = torch.Generator().manual_seed(cfg.seed)

    # -- requests ----------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: bytes = b"",
    ) -> str:
        """Queue a request; raises InvalidArgument for anything it could never serve."""
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already running")
        self._validate(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params, cache_salt=cache_salt, arrival=arrival)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise InvalidArgument("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} "
                "(room for at least one new token is needed)"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidArgument(f"prompt has token ids outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer; this model folder has none")
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        if -(-longest // self.config.block_size) > self.config.num_blocks:
            raise InvalidArgument(
                f"request needs up to {longest} tokens of KV, more than this engine's pool "
                f"({self.config.num_blocks} blocks of {self.config.block_size})"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks at once."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise NotFound(f"no running request {request_id!r}")
        self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        if not batch:
            return []
        sampling, logits = self._forward(batch)
        self.scheduler.after_step(batch)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(batch.num_new)
        outputs = []
        if sampling:
            tokens = sample(logits, sampling, self._default_gen)
            for seq, tok in zip(sampling, tokens):
                outputs.append(self._append_token(seq, tok))
        return outputs

    def _forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens = []
        logits_idx = []
        sampling = []
        for seq, n in zip(batch.seqs, batch.num_new):
            a, b = seq.num_computed, seq.num_computed + n
            ids.extend(seq.all_ids[a:b])
            positions.extend(range(a, b))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(a, b))
            starts.append(starts[-1] + n)
            seq_lens.append(b)
            if b == seq.num_tokens:  # the whole context is in cache: this row samples
                logits_idx.append(starts[-1] - 1)
                sampling.append(seq)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=dev),
            is_decode=all(n == 1 for n in batch.num_new),
        )
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv.tensor,
            meta,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        return sampling, logits.cpu()

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        n_lp = len(seq.logprobs)
        delta_start = seq.emitted_text_len
        if seq.detok is not None:
            seq.detok.add(token)
        reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
        text = releasable_text(seq, finished=reason is not None)
        seq.emitted_text_len = delta_start + len(text)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            text_delta=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=seq.logprobs[n_lp - 1 :] if seq.params.logprobs is not None else [],
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_prompt,
        )

    # -- convenience -----------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, Completion] = {}
        acc: dict[str, tuple[list[int], list[str], list[TokenLogprob]]] = {r: ([], [], []) for r in rids}
        while self.has_unfinished():
            for out in self.step():
                toks, texts, lps = acc[out.request_id]
                toks.extend(out.new_token_ids)
                texts.append(out.text_delta)
                lps.extend(out.new_logprobs)
                if out.finished:
                    done[out.request_id] = Completion(
                        out.request_id,
                        prompts[rids.index(out.request_id)],
                        toks,
                        "".join(texts),
                        out.finish_reason or "",
                        lps,
                        out.num_cached_tokens,
                    )
        return [done[r] for r in rids]

    # -- KV export / import ------------------------------------------------------

    def kv_layout(self) -> dict:
        mc = self.model_config
        return {
            "block_size": self.config.block_size,
            "dtype": dtype_name(self.dtype),
            "layout": KV_LAYOUT,
            "num_layers": mc.num_layers,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "model_fingerprint": self.fingerprint,
        }

    def prompt_block_hashes(self, prompt_ids: list[int], cache_salt: bytes = b"") -> list[BlockHash]:
        return block_hashes(prompt_ids, self.config.block_size, self.fingerprint, cache_salt)

    def export_blocks(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, BlockPayload]]:
        """The KV of each named block this engine holds (missing ones are skipped)."""
        out = []
        for h in hashes:
            b = self.blocks.hash_to_block.get(h)
            if b is not None:
                out.append((h, self.kv.export_block(b)))
        self.stats.exported_blocks += len(out)
        return out

    def import_block(self, h: BlockHash, payload: BlockPayload) -> bool:
        """Adopt a block computed elsewhere as a cached block. False if already held."""
        if h in self.blocks.hash_to_block:
            return False
        (b,) = self.blocks.allocate(1)
        try:
            self.kv.import_block(b, payload)
        except Exception:
            self.blocks.release([b])
            raise
        self.blocks.register(b, h)
        self.blocks.release([b])  # cached-free: reusable by the next request with this prefix
        self.stats.imported_blocks += 1
        return True
