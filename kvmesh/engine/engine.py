"""The engine: requests in, tokens out, one batched forward pass per step.

Single-threaded by design: a service runs ``step()`` in its own thread and
talks to it through queues (``kvmesh.engine.async_engine``), so a forward pass
never blocks the event loop.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import structlog
import torch

from kvmesh.blocks import BlockHash
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.block_manager import BlockEventSink, BlockManager
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.draft_source import DraftSource
from kvmesh.engine.grammar import GrammarCache, GrammarStats
from kvmesh.engine.kv_handoff import KVHandoff
from kvmesh.engine.lora import AdapterInfo, LoraAdapters
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.outputs import Completion, EngineStats, InjectedFault, RequestOutput
from kvmesh.engine.sampler import DRAFTS, position_generator, token_logprobs, verify
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.sequence import Sequence, TokenLogprob
from kvmesh.engine.stop import check_stop, releasable_text
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import FailedPrecondition, InvalidArgument, KvmeshError, NotFound, RequestFailed
from kvmesh.sampling import SamplingParams, admitted

log = structlog.get_logger(__name__)


class LLMEngine(KVHandoff):
    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig | None = None,
        on_block_event: BlockEventSink | None = None,
        drafter: DraftSource | None = None,
    ):
        self.config = cfg = config or EngineConfig()
        path = Path(model_path)
        if not path.is_dir():
            raise InvalidArgument(f"model path {path} is not a directory")
        self.model_config = mc = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        eos = set(mc.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.runner = ModelRunner(path, cfg, mc, drafter, self.eos_token_ids)
        self.model, self.kv, self.fingerprint = self.runner.model, self.runner.kv, self.runner.fingerprint
        self.system_fingerprint = self.runner.system_fingerprint  # OpenAI's, for every response
        self.device, self.dtype, self.max_model_len = self.runner.device, self.runner.dtype, self.runner.max_model_len
        self.blocks = BlockManager(cfg.num_blocks, cfg.enable_prefix_cache, on_block_event)
        self.lora = self.runner.lora
        # Blocks fall out of use only when every layer slides (one full-attention layer reads them all).
        window = min(mc.layer_windows, default=0)
        self.scheduler = Scheduler(
            self.blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.lora, window
        )
        self.stats = EngineStats()
        self.drafter = drafter
        # Outputs produced outside a step (a handed-off first token), delivered with the next one.
        self._pending: list[RequestOutput] = []
        # request id -> (hash, block id) of prompt blocks held for a hand-off.
        self._held: dict[str, list[tuple[BlockHash, int]]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._default_gen = torch.Generator().manual_seed(cfg.seed)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()

    def close(self) -> None:
        """Let go of what outlives the object: the other tensor-parallel ranks' processes."""
        self.runner.close()

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
        traceparent: str | None = None,
        adapter: str | None = None,
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
        ``adapter`` runs it under that loaded LoRA adapter (NotFound if none is loaded by that name).
        """
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already running")
        if request_id in self._held:
            raise InvalidArgument(f"request id {request_id!r} still holds its prompt's blocks for a hand-off")
        params = self._admissible(prompt_ids, params)
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            cache_salt=cache_salt,
            fingerprint=self.chain_fingerprint(adapter),
            adapter=adapter,
            arrival=arrival,
            hold_prompt_blocks=hold_prompt_blocks,
            traceparent=traceparent,
        )
        if params.seed is not None:
            seq.draft_generator = position_generator(params.seed, 0, DRAFTS)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids, params.skip_special_tokens)
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
        if adapter is not None:
            self.lora.hold(adapter)  # last: nothing below can fail and leave it held
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        if first_token is not None:
            if params.logprobs is not None:
                seq.logprobs.append(first_logprob or TokenLogprob(first_token, float("nan")))
            self._pending.append(self._append_tokens(seq, [first_token]))
        return request_id

    # -- LoRA adapters (any thread; kvmesh.engine.lora) -------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Load a PEFT adapter that requests can then name; InvalidArgument says what is wrong with it."""
        return self._adapters().load(name, path)

    def unload_adapter(self, name: str) -> None:
        self._adapters().unload(name)

    def adapters(self) -> list[AdapterInfo]:
        return [] if self.lora is None else self.lora.list()

    def _adapters(self) -> LoraAdapters:
        if self.lora is None:
            raise FailedPrecondition("LoRA is off on this worker (max_loras 0)")
        return self.lora

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
        if self.drafter is not None:
            self.drafter.finished(seq)

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
        if self.config.fault_after_steps and self.stats.steps >= self.config.fault_after_steps:
            raise InjectedFault(f"injected engine fault after {self.stats.steps} steps")
        outputs, self._pending = self._pending, []
        if self.drafter is not None:
            decoding = [seq for seq in self.scheduler.running if seq.is_decoding]
            # Room under max_tokens and the context, beside the bonus token every verify adds.
            rooms = [
                min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens) - 1 for s in decoding
            ]
            self.drafter.draft(list(zip(decoding, rooms)), self.model_config.vocab_size)
        batch = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        if not batch:
            return outputs
        sampling, logits, hidden = self.runner.forward(batch, self.stats)
        self.scheduler.after_forward(batch)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(batch.num_new)
        greedy = logits.argmax(dim=-1).tolist()
        row = 0
        for seq in sampling:
            k = len(seq.draft_ids)
            # A failure that belongs to one sequence (its penalties, grammar, sampling, a token it
            # makes) fails that request alone; the step goes on for every other one.
            try:
                if seq.error is not None:  # in the runner's part of the step (kvmesh.engine.model_runner)
                    raise seq.error
                outputs.append(self._sample(seq, logits[row : row + k + 1], greedy[row : row + k + 1], hidden, row))
            except Exception as e:
                outputs.append(self._fail(seq, e))
            row += k + 1
        return outputs

    def _sample(
        self, seq: Sequence, rows: torch.Tensor, greedy: list[int], hidden: torch.Tensor | None, row: int
    ) -> RequestOutput:
        """Verify ``seq``'s drafts on its logits ``rows`` (one more than drafts), sample what follows, append."""
        drafts, seq.draft_ids = seq.draft_ids, []
        draft_probs, seq.draft_probs = seq.draft_probs, None
        k = len(drafts)
        seed, position = seq.params.seed, len(seq.output_ids)
        if seed is None or seq.params.greedy:
            gens = [self._default_gen] * (k + 1)
        else:  # a resumed request's output starts with what it resumes: positions run on from there
            gens = [position_generator(seed, position + i) for i in range(k + 1)]
        probs = draft_probs[:k] if k and draft_probs is not None else None
        # Deterministic serving keeps a sampled token what plain decoding draws: the same text with drafts or without.
        tokens = verify(rows, drafts, seq.params, gens, greedy, probs, exact=self.config.deterministic)
        if hidden is not None:  # the row that sampled the last token
            seq.feature = hidden[row + len(tokens) - 1]
        if k:
            seq.num_draft_proposed += k
            seq.num_draft_accepted += len(tokens) - 1
            seq.num_draft_missed += len(tokens) - 1 < k
            self.drafter.verified(k, len(tokens) - 1)
            self.stats.draft_tokens_proposed += k
            self.stats.draft_tokens_accepted += len(tokens) - 1
        if seq.params.logprobs is not None:
            seq.logprobs.extend(token_logprobs(rows, tokens, seq.params.logprobs))
        out = self._append_tokens(seq, tokens)
        if k and not seq.is_finished:
            self.scheduler.accept_drafts(seq, len(tokens) - 1)
        return out

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End ``seq`` now, its blocks freed, with ``error`` for its caller (a domain error as it is,
        anything else as RequestFailed: the request's failure, not the worker's)."""
        log.error("request failed in the engine; the others go on", request_id=seq.request_id, exc_info=error)
        if not isinstance(error, KvmeshError):
            error = RequestFailed(f"request {seq.request_id} failed in the engine: {type(error).__name__}: {error}")
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self._seqs.pop(seq.request_id, None)
        if self.drafter is not None:
            self.drafter.finished(seq)
        self.stats.failed_requests += 1
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason="error",
            new_logprobs=[],
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_prompt,
            error=error,
        )

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
            if self.drafter is not None:
                self.drafter.finished(seq)
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
            added_ns=seq.added_ns,
            admitted_ns=seq.admitted_ns,
            num_preemptions=max(seq.admissions - 1, 0),
            num_draft_proposed=seq.num_draft_proposed,
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
