"""The engine's step loop on its own thread, fed and drained through queues.

A forward pass can take tens of milliseconds; running it on the asyncio loop
would stall every gRPC stream, health check and cancellation in the process.
So one thread owns the ``LLMEngine`` outright: coroutines hand it commands
(add, abort, or any function to run between steps, e.g. KV export/import)
through a thread-safe queue, and each request's outputs come back through an
``asyncio.Queue`` filled with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from kvmesh import tracing
from kvmesh.blocks import BlockHash
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv_cache import KVCache
from kvmesh.engine.outputs import RequestOutput
from kvmesh.errors import Unavailable
from kvmesh.sampling import SamplingParams

T = TypeVar("T")
log = structlog.get_logger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle thread blocks before re-checking for shutdown (stop() also wakes it)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None, on_fatal: Callable[[str], None] | None = None) -> None:
        """Wrap a built engine; services use ``started`` instead, which builds it on the loop thread.

        ``on_fatal(reason)`` is called (on the engine thread) when the step loop dies of a failure no single
        request owns, before every stream is failed with UNAVAILABLE; a service stops serving and exits, so
        its supervisor restarts it (never a live process with a dead engine)."""
        self.engine = engine
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    def start(self) -> None:
        self._start_thread(self._run)

    def _start_thread(self, target: Callable[..., None], *args: Any) -> None:
        self._thread = threading.Thread(target=target, args=args, name="engine-step-loop", daemon=True)
        self._thread.start()

    @classmethod
    async def started(
        cls, build: Callable[[], LLMEngine], on_fatal: Callable[[str], None] | None = None
    ) -> AsyncEngine:
        """Build the engine on the step-loop thread itself, start the loop, return once built.

        Why its own thread: libgomp throttles its spin-waiting once a process holds more OpenMP
        threads than CPUs, and every thread that runs torch ops keeps a team of its own. An
        engine loaded on another thread (``asyncio.to_thread``) leaves that thread's team
        behind, and every parallel op of every step then pays a sleeping worker's wake-up:
        measured on 2 cores, one stream at 19 tok/s instead of 29. A build that raises
        raises here.
        """
        built: concurrent.futures.Future = concurrent.futures.Future()
        self = cls(None, on_fatal)
        self._start_thread(self._build_and_run, build, built)
        await asyncio.wrap_future(built)
        return self

    def _build_and_run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            self.engine = build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        self._run()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put((lambda engine: None, concurrent.futures.Future()))  # wakes an idle loop now
        if self._thread is not None:
            self._thread.join()
        if self.engine is not None:
            self.engine.close()

    # -- what never changes once the engine is built: safe to read from any thread -----------------

    @property
    def kv(self) -> KVCache:
        """The engine's KV pool: its layout and memory are fixed; its blocks change on the engine thread."""
        return self.engine.kv

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    def kv_layout(self) -> dict:
        return self.engine.kv_layout()

    def prompt_block_hashes(
        self, prompt_ids: list[int], cache_salt: bytes = b"", adapter: str | None = None
    ) -> list[BlockHash]:
        """The names of a prompt's full blocks (a pure function of the prompt, salt, model and adapter)."""
        return self.engine.prompt_block_hashes(prompt_ids, cache_salt, adapter)

    # -- the engine thread ---------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if self._fatal is not None:
            raise Unavailable("this worker's engine failed; it is restarting") from self._fatal
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        if self._fatal is not None:  # died meanwhile: nothing will run it
            self._fail_pending()
        return await asyncio.wrap_future(fut)

    def _fail_pending(self) -> None:
        """Fail every queued command (the engine thread is gone)."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(Unavailable("this worker's engine failed; it is restarting"))

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: bytes = b"",
        **add_options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the loop early (or being cancelled) aborts it.

        ``add_options`` go to ``LLMEngine.add_request`` (first_token, hold_prompt_blocks, ...).
        """
        out_q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if params.grammar is not None:
            # Compile off the engine thread (a large schema takes a while): add_request then
            # finds it cached, and a bad grammar fails here without touching the step loop.
            grammar = params.grammar
            # Under the request's span: a cache hit shows as a sliver, a cold compile as what it cost.
            with tracing.span("grammar.compile", **{"kvmesh.grammar.kind": grammar.kind}):
                await asyncio.to_thread(lambda: self.engine.grammars.compiled(grammar))

        def add(engine: LLMEngine) -> str:
            rid = engine.add_request(prompt_ids, params, request_id, cache_salt, **add_options)
            self._streams[rid] = (loop, out_q)
            return rid

        request_id = await self.call(add)  # the engine names an unnamed request
        finished = False
        try:
            while not finished:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await asyncio.shield(self.call(lambda e: self._abort(e, request_id)))

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            engine.abort(request_id)

    # -- engine thread -------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not engine.has_unfinished())
                if not engine.has_unfinished():
                    continue
                for out in engine.step():
                    self._deliver(out.request_id, out.error or out, out.finished)
        except BaseException as e:  # a dead step loop must fail every waiter, not hang them
            self._fatal = e
            log.exception("engine step loop died: failing every request, the worker stops serving")
            if self._on_fatal is not None:  # first: no new call may arrive between
                self._on_fatal(f"the engine's step loop died: {type(e).__name__}: {e}")
            for rid in list(self._streams):
                self._deliver(rid, Unavailable(f"this worker's engine failed ({type(e).__name__}: {e})"), True)
            self._fail_pending()

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # the caller gets it: e.g. InvalidArgument from add_request
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)
