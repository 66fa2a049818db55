"""LoRA adapters as the gateway sees them: which model names are adapters, and loading one everywhere.

Workers hold adapters (``kvmesh.engine.lora``) and report them to the router with their load; the
gateway reads that list (the router's ``ListWorkers``) for ``/v1/models`` and to tell an adapter's
name from an unknown model's. Loading fans out to every prefill and decode worker: an adapter is
served by all of them or, when one refuses it, by none (the workers that had just loaded it unload
it again), so a request never depends on which worker the router picks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvmesh.api.adapter.v1 import adapter_pb2
from kvmesh.api.common.v1 import worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import InvalidArgument, KvmeshError, NotFound, Unavailable
from services.gateway.backends import Backends
from services.gateway.model import UnknownModel

log = structlog.get_logger(__name__)

_ROLES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode"}


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    workers: int  # prefill and decode workers that have it loaded
    resident: int  # of those, how many hold it in a slot now


class Adapters:
    def __init__(
        self,
        backends: Backends,
        base_model: str,
        *,
        max_age_s: float = 1.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backends = backends
        self._base = base_model
        self._max_age_s = max_age_s
        self._now = now
        self._known: dict[str, ServedAdapter] = {}
        self._read_at = -float("inf")

    async def catalog(self) -> list[ServedAdapter]:
        """Every adapter some worker has loaded, as the router saw them last (read at most once per
        ``max_age_s``; while the router cannot be asked, the last list read)."""
        if self._now() - self._read_at > self._max_age_s:
            await self._read()
        return sorted(self._known.values(), key=lambda a: a.name)

    async def resolve(self, model: str) -> str:
        """The adapter a request's ``model`` names ("" for the base model, or an empty name);
        UnknownModel for a name that is neither."""
        if not model or model == self._base:
            return ""
        if model not in self._known and self._now() - self._read_at > self._max_age_s:
            await self._read()  # loaded since the last read, perhaps
        if model not in self._known:
            served = ", ".join(repr(n) for n in [self._base, *sorted(self._known)])
            raise UnknownModel(f"model {model!r} is not served here; this gateway serves {served}")
        return model

    async def load(self, name: str, path: str) -> ServedAdapter:
        """Load the PEFT folder ``path`` as ``name`` on every prefill and decode worker."""
        if not name or name == self._base:
            raise InvalidArgument(f"an adapter needs a name other than the base model's ({self._base!r})")
        if not path:
            raise InvalidArgument("lora_path is empty: name the adapter's PEFT folder")
        workers = await self._workers()
        request = adapter_pb2.LoadAdapterRequest(name=name, path=path)
        results = await asyncio.gather(
            *(self._backends.load_adapter(w.endpoint.address, _ROLES[w.role], request) for w in workers),
            return_exceptions=True,
        )
        failures = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if failures:
            had = [w for w in workers if any(a.name == name for a in w.load.adapters)]
            fresh = [w for w, r in zip(workers, results) if not isinstance(r, BaseException) and w not in had]
            await self._unload_from(fresh, name)
            worker, error = failures[0]
            log.warning("lora adapter refused", adapter=name, worker_id=worker.endpoint.worker_id, error=str(error))
            raise error if isinstance(error, KvmeshError) else Unavailable(f"loading {name!r}: {error}")
        served = self._known[name] = ServedAdapter(name, len(workers), sum(r.adapter.resident for r in results))
        log.info("lora adapter loaded", adapter=name, path=path, workers=len(workers))
        return served

    async def unload(self, name: str) -> int:
        """Unload ``name`` from every worker that has it; returns how many. NotFound when none has it."""
        holders = [w for w in await self._workers() if any(a.name == name for a in w.load.adapters)]
        if not holders:
            raise NotFound(f"adapter {name!r} is not loaded on any worker")
        await self._unload_from(holders, name, strict=True)
        self._known.pop(name, None)
        log.info("lora adapter unloaded", adapter=name, workers=len(holders))
        return len(holders)

    async def _unload_from(self, workers: list[router_pb2.WorkerStatus], name: str, strict: bool = False) -> None:
        request = adapter_pb2.UnloadAdapterRequest(name=name)
        results = await asyncio.gather(
            *(self._backends.unload_adapter(w.endpoint.address, _ROLES[w.role], request) for w in workers),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, NotFound)]
        if strict and errors:
            # Workers that could unload it did: it is served by fewer workers until the rest are free.
            raise errors[0] if isinstance(errors[0], KvmeshError) else Unavailable(f"unloading {name!r}: {errors[0]}")

    async def _workers(self) -> list[router_pb2.WorkerStatus]:
        listed = await self._backends.list_workers()
        workers = [w for w in listed.workers if w.role in _ROLES]
        if not workers:
            raise Unavailable("no prefill or decode worker is registered with the router")
        return workers

    async def _read(self) -> None:
        try:
            listed = await self._backends.list_workers()
        except KvmeshError as e:
            # The base model is still served: /v1/models and base requests must not fail with the router.
            log.warning("could not list the workers' adapters; keeping the last list", error=e.message)
            self._read_at = self._now()
            return
        known: dict[str, ServedAdapter] = {}
        for w in listed.workers:
            if w.role not in _ROLES:
                continue
            for a in w.load.adapters:
                old = known.get(a.name, ServedAdapter(a.name, 0, 0))
                known[a.name] = ServedAdapter(a.name, old.workers + 1, old.resident + a.resident)
        self._known, self._read_at = known, self._now()
