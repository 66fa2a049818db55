"""The engine: requests in, tokens out, one batched forward pass per step.

Single-threaded by design: a service runs ``step()`` in its own thread and
talks to it through queues (``kvmesh.engine.async_engine``), so a forward pass
never blocks the event loop.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
import torch

from kvmesh.blocks import BlockHash, block_hashes, model_fingerprint
from kvmesh.checkpoint.compressed import dequantized_tensors
from kvmesh.checkpoint.files import weight_files, weights_id
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.block_manager import BlockEventSink, BlockManager, OutOfBlocks
from kvmesh.engine.compile import compile_decode
from kvmesh.engine.config import EngineConfig, dtype_name
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.draft_length import DraftLengthPolicy
from kvmesh.engine.grammar import GrammarCache, GrammarStats, MaskRows, Masks, allowed_prefix
from kvmesh.engine.kv_cache import KV_LAYOUT, BlockPayload, KVCache
from kvmesh.engine.model import CausalLM
from kvmesh.engine.penalties import PenaltyState, adjust_row
from kvmesh.engine.sampler import token_logprobs, verify
from kvmesh.engine.scheduler import ScheduledBatch, Scheduler
from kvmesh.engine.sequence import Sequence, TokenLogprob
from kvmesh.engine.step_metadata import step_metadata
from kvmesh.engine.stop import check_stop, releasable_text
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.engine.verify_cost import measure_draft_costs
from kvmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from kvmesh.sampling import SamplingParams, admitted

log = structlog.get_logger(__name__)

# Mixes the resume point into a resumed request's seed (an odd 63-bit constant: the golden ratio).
_RESUME_SEED_STEP = 0x4F1BBCDCBFA53E0B


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
    # Of new_token_ids, how many were speculator drafts the model accepted.
    num_draft_accepted: int = 0


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
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    grammar_masked_rows: int = 0  # logits rows masked by a request's grammar
    grammar_mask_seconds: float = 0.0  # engine-thread time spent filling and applying those masks


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


class DraftProposer(Protocol):
    """Where speculative drafts come from (the speculator service, or a local n-gram).

    A proposer that reads the target (an EAGLE head) has a ``bind(model)`` method, called
    once the model is loaded, and a true ``wants_features``: it then finds each sequence's
    target feature in ``seq.feature``, the final hidden state of the row that sampled its
    last token, or the outputs of the target's layers it names in ``feature_layers``
    (read after ``bind``), concatenated. One whose drafting takes time on the engine thread
    says how much with ``draft_seconds(k)`` (k drafts for one sequence, read after ``bind``),
    so the draft-length policy prices it (``kvmesh.engine.verify_cost``).
    """

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to k draft tokens per (sequence, k); may return fewer or none (late answers)."""
        ...

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: its output can teach the proposer."""
        ...


class LLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig | None = None,
        on_block_event: BlockEventSink | None = None,
        proposer: DraftProposer | None = None,
    ):
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
        # A compressed-tensors checkpoint (kvmesh quantize) is dequantized on load.
        self.model.load_weights(files, dequantized_tensors(mc.raw, files))
        self.model.to(self.device).eval()
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
            },
            dtype_name(self.dtype),
            cfg.block_size,
        )
        if hasattr(proposer, "bind"):
            # Before the decode step is compiled: the features it returns are traced with it.
            proposer.bind(self.model)
            self.model.feature_layers = tuple(getattr(proposer, "feature_layers", ()))
        self.kv = KVCache(
            mc.num_layers, cfg.num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        if cfg.compile:
            compile_decode(self.model, self.kv.tensor)  # before any block holds KV
        self._draft_length = DraftLengthPolicy(cfg.num_speculative_tokens, self._draft_costs(proposer))
        self.blocks = BlockManager(cfg.num_blocks, cfg.enable_prefix_cache, on_block_event)
        self.scheduler = Scheduler(
            self.blocks, cfg.block_size, self.fingerprint, cfg.max_num_seqs, cfg.max_num_batched_tokens
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self.proposer = proposer
        self._wants_features = bool(getattr(proposer, "wants_features", False))
        # Outputs produced outside a step (a handed-off first token), delivered with the next one.
        self._pending: list[RequestOutput] = []
        # request id -> (hash, block id) of prompt blocks held for a hand-off.
        self._held: dict[str, list[tuple[BlockHash, int]]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._default_gen = torch.Generator().manual_seed(cfg.seed)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()

    def _draft_costs(self, proposer: DraftProposer | None) -> dict[int, tuple[float, ...]]:
        """The draft-length policy's prices per batch size: the configured table (at every size);
        else measured on CPU, where a verify row costs what the processor makes it (before any
        block holds KV: the probe writes pool blocks); free on a GPU, where verify rows are
        nearly free at small batch."""
        cfg = self.config
        if cfg.draft_costs is not None:
            return {1: tuple(cfg.draft_costs)}
        if proposer is None or cfg.num_speculative_tokens == 0 or self.device.type != "cpu":
            return {1: ()}
        return measure_draft_costs(
            self.model,
            self.kv.tensor,
            cfg.num_speculative_tokens,
            self.max_model_len,
            getattr(proposer, "draft_seconds", None),
        )

    @property
    def draft_costs(self) -> dict[int, tuple[float, ...]]:
        """Per batch size, a verify of 1, 2, ... drafts in decode steps' time, as the draft-length
        policy prices it (a step of n sequences: the table of the largest size <= n)."""
        return self._draft_length.costs

    @property
    def grammars(self) -> GrammarCache:
        """Compiles constraints for this model (built on first use: the vocabulary scan takes a moment).

        Safe to use from any thread (services compile off the engine thread first).
        """
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidArgument("structured outputs need a tokenizer; this model folder has none")
                self._grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    @property
    def grammar_stats(self) -> GrammarStats:
        return self._grammars.stats if self._grammars is not None else GrammarStats()

    # -- requests ----------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: bytes = b"",
        first_token: int | None = None,
        first_logprob: TokenLogprob | None = None,
        hold_prompt_blocks: bool = False,
        resume_ids: list[int] | None = None,
    ) -> str:
        """Queue a request; raises InvalidArgument for anything it could never serve.

        ``first_token`` continues a request whose prompt was prefilled elsewhere: the token
        that worker sampled is appended as this request's first output (stop checks and
        streaming as usual) and the next step computes only what the cache lacks.
        ``hold_prompt_blocks`` keeps the prompt's full blocks referenced after the request
        finishes, for a KV hand-off, until ``release_held``.
        ``resume_ids`` continues a request another worker had started (a migration): those
        tokens are its output so far, already delivered, so they count against max_tokens,
        stop strings and the repetition guard and advance its grammar, but are not emitted
        again; the first step computes their KV with the prompt's and samples what follows.
        """
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already running")
        params = self._admissible(prompt_ids, params)
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            cache_salt=cache_salt,
            arrival=arrival,
            hold_prompt_blocks=hold_prompt_blocks,
        )
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
        if first_token is not None and not 0 <= first_token < self.model_config.vocab_size:
            raise InvalidArgument(f"first token {first_token} is outside the vocabulary")
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
            if first_token is not None and not self.grammars.allows(seq.grammar, first_token):
                raise InvalidArgument(f"first token {first_token} is not allowed by the request's grammar")
        if resume_ids:
            if first_token is not None:
                raise InvalidArgument("a resumed request is prefilled here: it cannot also carry a first token")
            self._resume(seq, resume_ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        if first_token is not None:
            if params.logprobs is not None:
                seq.logprobs.append(first_logprob or TokenLogprob(first_token, float("nan")))
            self._pending.append(self._append_tokens(seq, [first_token]))
        return request_id

    def _resume(self, seq: Sequence, resume_ids: list[int]) -> None:
        """Put the tokens another worker already delivered in place as this sequence's output."""
        p = seq.params
        if len(resume_ids) >= p.max_tokens or seq.num_tokens + len(resume_ids) >= self.max_model_len:
            raise InvalidArgument(
                f"{len(resume_ids)} resumed tokens leave no room to generate (max_tokens {p.max_tokens})"
            )
        vocab = self.model_config.vocab_size
        for token in resume_ids:
            if not 0 <= token < vocab:
                raise InvalidArgument(f"resumed token {token} is outside the vocabulary")
            seq.output_ids.append(token)
            if seq.detok is not None:
                seq.detok.add(token)
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                raise InvalidArgument(f"resumed token {token} is not allowed by the request's grammar there")
        # The text the first worker had released: all of it but a tail that might begin a
        # stop string, which it held back (and this worker releases or cuts later, as it would have).
        seq.emitted_text_len = len(releasable_text(seq, finished=False))
        if p.seed is not None:
            # The same seed from the same point again, not the stream of draws that made the
            # first tokens: a resumed sampled request is a valid continuation, reproducible for
            # a given resume point, but not the text an unbroken run would have sampled.
            seq.generator = torch.Generator().manual_seed((p.seed + _RESUME_SEED_STEP * len(resume_ids)) % 2**63)

    def _admissible(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """``params`` resolved with the contract's defaults and checked with the prompt (kvmesh.sampling),
        then against this engine: InvalidArgument naming what it could never serve."""
        params = admitted(params, prompt_ids, self.model_config.vocab_size, self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer; this model folder has none")
        longest = len(prompt_ids) + params.max_tokens
        if -(-longest // self.config.block_size) > self.config.num_blocks:
            raise InvalidArgument(
                f"request needs up to {longest} tokens of KV, more than this engine's pool "
                f"({self.config.num_blocks} blocks of {self.config.block_size})"
            )
        return params

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks at once."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise NotFound(f"no running request {request_id!r}")
        self.scheduler.finish(seq, "abort")
        if self.proposer is not None:
            self.proposer.finished(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def tokens_in_flight(self) -> int:
        """Prompt tokens still to compute plus tokens still to generate, over all requests.

        Safe to read from another thread (copies the queues first); a load signal only.
        """
        seqs = [*self.scheduler.running, *list(self.scheduler.waiting)]
        return sum(s.num_tokens - s.num_computed + s.params.max_tokens - len(s.output_ids) for s in seqs)

    # -- stepping ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.proposer is not None and self.config.num_speculative_tokens:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        if not batch:
            return outputs
        sampling, logits, hidden = self._forward(batch)
        self.scheduler.after_forward(batch)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(batch.num_new)
        greedy = logits.argmax(dim=-1).tolist()
        row = 0
        for seq in sampling:
            drafts, seq.draft_ids = seq.draft_ids, []
            draft_probs, seq.draft_probs = seq.draft_probs, None
            k = len(drafts)
            gen = seq.generator or self._default_gen
            rows = logits[row : row + k + 1]
            tokens = verify(
                rows,
                drafts,
                seq.params,
                gen,
                greedy[row : row + k + 1],
                draft_probs[:k] if k and draft_probs is not None else None,
            )
            if hidden is not None:  # the row that sampled the last token
                seq.feature = hidden[row + len(tokens) - 1]
            row += k + 1
            if k:
                seq.num_draft_proposed += k
                seq.num_draft_accepted += len(tokens) - 1
                seq.num_draft_missed += len(tokens) - 1 < k
                self._draft_length.record(k, len(tokens) - 1)
                self.stats.draft_tokens_proposed += k
                self.stats.draft_tokens_accepted += len(tokens) - 1
            if seq.params.logprobs is not None:
                seq.logprobs.extend(token_logprobs(rows, tokens, seq.params.logprobs))
            outputs.append(self._append_tokens(seq, tokens))
            if k and not seq.is_finished:
                self.scheduler.accept_drafts(seq, len(tokens) - 1)
        return outputs

    def _propose_drafts(self) -> None:
        want = {}
        decoding = [seq for seq in self.scheduler.running if seq.is_decoding]
        for seq in decoding:
            # Room left under max_tokens and the context: the bonus token needs a slot too.
            room = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens) - 1
            if room > 0:
                k = self._draft_length.choose(seq.num_draft_accepted, seq.num_draft_missed, room, len(decoding))
                want[seq.request_id] = (seq, k)
        if not want:
            return
        for rid, drafts in self.proposer.propose([(s, k) for s, k in want.values()]).items():
            seq, k = want.get(rid, (None, 0))
            if seq is not None:
                # Drafts sampled from a distribution (an EAGLE head's) carry it as ``probs``.
                probs = getattr(drafts, "probs", None)
                kept = [t for t in drafts[:k] if 0 <= t < self.model_config.vocab_size]
                seq.draft_ids = allowed_prefix(seq.grammar, kept) if seq.grammar is not None else kept
                # Rows stay aligned only if no token was dropped before the kept ones; otherwise
                # the point-mass rule verifies them (exact for any draft, see sampler.verify).
                aligned = probs is not None and seq.draft_ids == list(drafts[: len(seq.draft_ids)])
                seq.draft_probs = probs[: len(seq.draft_ids)] if aligned else None

    def _forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
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
        out = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv.tensor,
            meta,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
            return_hidden=self._wants_features,
        )
        logits, hidden = out if self._wants_features else (out, None)
        self._adjust_logits(sampling, logits)
        # Launched (on a GPU still running): fill the grammar masks meanwhile, apply them on the
        # device, and only then wait for the logits.
        t0 = time.perf_counter()
        masks = self._grammar_masks(sampling, len(logits_idx))
        if masks is not None:
            self.stats.grammar_masked_rows += masks.apply(logits)
            self.stats.grammar_mask_seconds += time.perf_counter() - t0
        return sampling, logits.cpu(), hidden

    @torch.inference_mode()  # the logits are inference tensors: adjusting them in place needs it
    def _adjust_logits(self, sampling: list[Sequence], logits: torch.Tensor) -> None:
        """logit_bias and penalties on the rows of the sequences that ask for them (in place)."""
        row = 0
        for seq in sampling:
            k = len(seq.draft_ids)
            if seq.params.adjusts_logits:
                if seq.penalties is None:
                    seq.penalties = PenaltyState.new(seq.prompt_ids, seq.params, logits.shape[1], logits.device)
                seq.penalties.catch_up(seq.output_ids)
                for i in range(k + 1):
                    adjust_row(logits[row + i], seq.params, seq.penalties, seq.draft_ids[:i])
            row += k + 1

    def _grammar_masks(self, sampling: list[Sequence], num_rows: int) -> Masks | None:
        """The grammar masks of the constrained sequences' rows (None if there are none)."""
        rows, row = [], 0
        for seq in sampling:
            if seq.grammar is not None:
                rows.append(MaskRows(seq.grammar, row, list(seq.draft_ids)))
            row += len(seq.draft_ids) + 1
        return Masks(rows, num_rows, self.model_config.vocab_size) if rows else None

    def _append_tokens(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append tokens one by one until a stop condition; returns what the caller sees."""
        n_lp = len(seq.logprobs) - (len(tokens) if seq.params.logprobs is not None else 0)
        delta_start = seq.emitted_text_len
        reason = None
        appended = []
        for token in tokens:
            seq.output_ids.append(token)
            appended.append(token)
            if seq.detok is not None:
                seq.detok.add(token)
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # Masked sampling never gets here; if it did, the output would break the grammar.
                log.error("token outside the grammar", request_id=seq.request_id, token=token)
                reason = "abort"
                break
            reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                break
        self.stats.generated_tokens += len(appended)
        if seq.params.logprobs is not None:
            del seq.logprobs[n_lp + len(appended) :]  # logprobs of tokens cut by a stop
        text = releasable_text(seq, finished=reason is not None)
        seq.emitted_text_len = delta_start + len(text)
        if reason is not None:
            held = self.scheduler.finish(seq, reason, keep_prompt_blocks=seq.hold_prompt_blocks)
            if held:
                self._held[seq.request_id] = held
            del self._seqs[seq.request_id]
            if self.proposer is not None:
                self.proposer.finished(seq)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=appended,
            text_delta=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=seq.logprobs[n_lp:] if seq.params.logprobs is not None else [],
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_prompt,
            num_draft_accepted=len(appended) - 1 if appended else 0,
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

    def held_hashes(self, request_id: str) -> list[BlockHash]:
        """Names of the prompt blocks a finished ``hold_prompt_blocks`` request still holds."""
        return [h for h, _ in self._held.get(request_id, [])]

    def export_held(
        self, request_id: str, hashes: list[BlockHash] | None = None
    ) -> list[tuple[BlockHash, BlockPayload]]:
        """KV of held blocks (all, or those named, in the order named); unknown names skipped."""
        by_hash = dict(self._held.get(request_id, []))
        wanted = hashes if hashes is not None else list(by_hash)
        out = [(h, self.kv.export_block(by_hash[h])) for h in wanted if h in by_hash]
        self.stats.exported_blocks += len(out)
        return out

    def release_held(self, request_id: str) -> int:
        """Drop a hand-off's hold; the blocks stay cached until evicted. Returns how many."""
        held = self._held.pop(request_id, [])
        self.blocks.release([b for _, b in held])
        return len(held)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Pool block of each held block, in ``held_hashes`` order (a NIXL reader addresses them)."""
        return [b for _, b in self._held.get(request_id, [])]

    def pin_held(self, request_id: str, hashes: list[BlockHash]) -> list[tuple[BlockHash, int]]:
        """One more reference on each named held block (in the order named; unknown names
        skipped), so a peer can read it after the hold ends; ``release_reserved`` drops it."""
        by_hash = dict(self._held.get(request_id, []))
        pinned = [(h, by_hash[h]) for h in hashes if h in by_hash]
        self.blocks.acquire([b for _, b in pinned])
        return pinned

    def reserve_blocks(self, n: int) -> list[int]:
        """Fresh blocks for KV written into the pool from outside (a NIXL READ): referenced and
        unnamed until ``adopt_reserved`` names them or ``release_reserved`` hands them back."""
        try:
            return self.blocks.allocate(n)
        except OutOfBlocks as e:
            raise ResourceExhausted(f"no room for {n} incoming KV blocks: {e}") from None

    def adopt_reserved(self, blocks: list[tuple[BlockHash, int]]) -> int:
        """Name reserved blocks whose KV has arrived (and been verified) as cached blocks, as
        ``import_block`` does; one whose name another block took meanwhile is dropped. Returns
        how many were adopted."""
        adopted = 0
        for h, b in blocks:
            if self.blocks.register(b, h):
                adopted += 1
        self.blocks.release([b for _, b in blocks])
        self.stats.imported_blocks += adopted
        return adopted

    def release_reserved(self, block_ids: list[int]) -> None:
        """Hand back reserved blocks whose KV never arrived whole."""
        self.blocks.release(block_ids)

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
