"""``DraftModelWorker``: the service's draft model, on a thread of its own.

A draft model call takes milliseconds (a few greedy steps over a batch of
contexts); on the event loop it would hold up every other stream's n-gram
drafts meanwhile. So one worker thread owns the ``DraftModelProposer``
(which is not thread-safe): it loads the model and runs each round's single
batched call, on copies of the contexts (``DraftPlan.model_context``), never
touching the speculator core.

The loop waits for a call until the round's deadline at most. A call still
queued then is cancelled, since nobody waits for it any more: a model too
slow for the decode workers' budget sheds work instead of piling it up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from kvmesh.errors import InvalidArgument
from kvmesh.speculation.draft_model import DraftModelProposer, DraftRequest, draft_engine_config
from kvmesh.speculation.speculator import DraftPlan

log = structlog.get_logger(__name__)


class DraftModelWorker:
    def __init__(self, model_path: str, device: str = "cpu", max_draft_tokens: int = 8) -> None:
        self.model_path = model_path
        self._device = device
        self._max_draft_tokens = max_draft_tokens
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")
        self._proposer: DraftModelProposer | None = None  # the worker thread's only
        self._refusal_logged = False  # the worker thread's only

    async def start(self) -> None:
        """Load the model, on the worker thread (a large one takes a while)."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._load)
        log.info("draft model loaded", path=self.model_path, device=self._device)

    async def draft(self, plans: Sequence[DraftPlan], deadline_ns: int | None = None) -> dict[str, list[int]]:
        """The draft model's greedy tokens for each plan's ``model_context``, by request id,
        in one batched call. {} when ``deadline_ns`` (``time.perf_counter_ns()``) passes
        first or the model refuses the round's contexts."""
        call = asyncio.get_running_loop().run_in_executor(self._thread, self._draft, list(plans))
        timeout = None if deadline_ns is None else max(0.0, (deadline_ns - time.perf_counter_ns()) / 1e9)
        try:
            # On timeout wait_for cancels the call: dropped if still queued, left to finish
            # (its result unread) if already running.
            return await asyncio.wait_for(call, timeout)
        except TimeoutError:
            return {}

    async def close(self) -> None:
        """Stop the worker thread once its current call (if any) is done; drop the model."""
        await asyncio.to_thread(self._thread.shutdown, wait=True, cancel_futures=True)
        self._proposer = None

    # -- the worker thread -------------------------------------------------------

    def _load(self) -> None:
        self._proposer = DraftModelProposer(
            self.model_path, draft_engine_config(self._device), max_draft_tokens=self._max_draft_tokens
        )

    def _draft(self, plans: list[DraftPlan]) -> dict[str, list[int]]:
        assert self._proposer is not None, "start() loads the model first"
        # One request per id: the model's own request ids must be unique within a call.
        requests = {p.request_id: DraftRequest(p.request_id, p.model_context, p.num_tokens) for p in plans}
        try:
            return self._proposer.draft(list(requests.values()))
        except InvalidArgument as e:
            # A token id outside the model's vocabulary: it does not share the target's
            # tokenizer. The n-gram drafts go on; say so once, not at every step.
            if not self._refusal_logged:
                log.warning(
                    "the draft model refused a context: does it share the target model's tokenizer?",
                    path=self.model_path,
                    error=str(e),
                )
                self._refusal_logged = True
            return {}
