"""A worker's KV pool on NIXL: registered once, read block by block by a peer.

The paged pool (``kvmesh.engine.kv_cache``) is one tensor, registered with a
NIXL agent (UCX backend) when the worker starts: host memory on CPU, device
memory on CUDA — the same code, which UCX turns into shared memory, TCP, RDMA
or NVLink as the peers allow. A block is not contiguous in the pool (it is
``[:, :, b]`` of ``[layers, 2, blocks, ...]``): it is ``2 * layers`` contiguous
pieces. But a run of consecutive blocks is contiguous within each (layer, k/v)
plane, so a READ names, per run of blocks consecutive on both sides, one
descriptor per plane (built with numpy per READ): a few large copies instead of
one per 16 KiB piece, which is what UCX's per-descriptor cost made the bottleneck.

A hand-off's READ goes in chunks (``BlockRead``; one below 32 MiB): each chunk's
blocks are checksummed on a worker thread as soon as they land, while the next
chunk is in flight, so verification costs about one chunk's checksum beyond the
copy. Over shared memory a chunk lands inside its post, and the same thread goes
straight on to its checksum: no hop back to the event loop in between.

Known behaviour of NIXL/UCX this module works around: a transfer can stay in
progress forever when its peer dies (every wait here has a deadline); UCX's
registration cache grows without bound unless told otherwise; its keepalive can
abort a process whose peer died (off); NIXL's progress thread spins a core
unless paced.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from kvmesh.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from kvmesh.worker.kv_transport import DEFAULT_PROGRESS_PAUSE_US
from kvmesh.worker.nixl_layout import PoolRegion, block_runs

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.kv_cache import KVCache

log = structlog.get_logger(__name__)

# UCX settings, unless the environment says otherwise:
# - the registration cache bounded as vLLM's NixlConnector bounds it: otherwise UCX keeps every
#   region it ever mapped for a peer's transfers, and a long-running worker's memory only grows;
# - no UCP keepalive: when it finds a peer dead while requests to it are pending (the holder of a
#   READ stalled, its reader killed meanwhile) UCX aborts the whole process ("Fatal: unexpected
#   error: Endpoint timeout", reproduced here over TCP). Dead peers are this code's to notice
#   anyway: a READ has a deadline, a lease a TTL, and a socket error still fails a transfer.
# - TCP segments of 256 KiB rather than 8 KiB: a READ over TCP (the cross-host mode) moves
#   faster with them (docs/measurements.md).
_UCX_DEFAULTS = {
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
    "UCX_KEEPALIVE_INTERVAL": "inf",
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
}
# How often a waiting READ asks whether it is done (the progress thread moves its bytes): soon
# at first (a small READ is done at once), then less often.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.001
# A BlockRead's chunks: at least this many bytes each, at most this many chunks. More chunks
# hide more of the checksum behind the copy, but each costs a transfer request and a thread
# (docs/measurements.md).
_READ_CHUNK_BYTES = 16 << 20
_MAX_READ_CHUNKS = 8
# Chunks posted at once: over shared memory each post copies in its thread, and two at once
# measured slower here than one after the other (the checksums already take the other core).
_POSTS_IN_FLIGHT = 1


def load_nixl() -> Any | None:
    """NIXL's Python API (``nixl_agent``, ``nixl_agent_config``), or None where it is not installed.

    PyPI's ``nixl-cu12`` wheel installs it as ``nixl_cu12``; the ``nixl`` meta-package as ``nixl``.
    """
    for name in ("nixl_cu12", "nixl._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
        return module
    return None


async def block_checksums(kv: KVCache, block_ids: list[int]) -> list[bytes]:
    """``kv.block_checksums`` of the blocks, on one worker thread, so the event loop and the
    engine keep going. One thread, not one per core: a block is summed piece by piece (16 KiB
    CRCs, the GIL taken between them), and split over two threads the same blocks took longer
    here (48 MiB of 8-token blocks: 22.6 vs 9.1 ms; 96 MiB of 16-token: 15.1 vs 14.0). Only for
    blocks nobody writes meanwhile (held by a lease, or reserved for a READ that ended)."""
    return await asyncio.to_thread(kv.block_checksums, block_ids)


@dataclass
class _Peer:
    agent_name: str
    region: PoolRegion


class NixlRead:
    """One READ (or WRITE) in flight. ``wait`` ends it (done, failed or past its deadline)."""

    def __init__(self, agent: Any, handle: Any, nbytes: int) -> None:
        self._agent, self._handle, self.nbytes = agent, handle, nbytes
        self.settled = False  # done or failed: no byte will land any more
        self._failed = False

    def done(self) -> bool:
        """True once every byte landed, False while in flight; Unavailable if the READ failed."""
        if not self.settled:
            try:
                state = self._agent.check_xfer_state(self._handle)
            except Exception:  # noqa: BLE001 - NIXL's errors (a disconnected peer) end the READ
                state = "ERR"
            if state == "PROC":
                return False
            self._failed = state == "ERR"
            self._finish()
        if self._failed:
            raise Unavailable("NIXL READ failed (the peer went away or refused it)")
        return True

    async def wait(self, timeout_s: float) -> None:
        """Returns once every byte landed; Unavailable if the READ failed, DeadlineExceeded past
        ``timeout_s`` (the READ may then still be in flight: see ``settle``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = _POLL_FIRST_S
        while not self.done():
            if loop.time() >= deadline:
                raise DeadlineExceeded(f"NIXL READ of {self.nbytes} bytes still in progress after {timeout_s:.1f} s")
            await asyncio.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    async def settle(self, timeout_s: float) -> bool:
        """After a failed or abandoned wait: cancel the READ, or wait until UCX gives up on it.
        True once no byte can land any more (the destination blocks may be reused)."""
        if self.settled:
            return True
        try:
            self._handle.release()  # cancels an active transfer where the backend can
            self.settled = True
            return True
        except Exception:  # noqa: BLE001 - NIXL raises its own error types for "cannot cancel"
            pass
        try:
            await self.wait(timeout_s)
        except (Unavailable, DeadlineExceeded):
            pass
        return self.settled

    def _finish(self) -> None:
        self.settled = True
        try:
            self._handle.release()
        except Exception as e:  # noqa: BLE001 - a finished transfer's handle; nothing to undo
            log.warning("releasing a finished NIXL transfer failed", error=str(e))


def _agent_with_paced_progress(nixl: Any, name: str, config: Any, pause_us: int) -> Any:
    """A ``nixl_agent`` whose progress thread pauses ``pause_us`` between rounds.

    The progress thread (C++, no GIL) is what moves a READ's bytes while neither side's Python
    asks, and on the holder what serves a READ over TCP and acknowledges one over shared memory
    (without it a 12 MiB READ waited ~10 ms more for the holder's next poll). NIXL's Python
    wrapper runs it without any pause — most of a core per idle worker, measured here — and
    exposes no setting for it, so the binding's constructor is wrapped for the one call to set
    the pause (idle cost ~3% of a core at a 100 us pause, measured; the 2 ms default wakes 20x
    less often).
    """
    bindings = sys.modules[nixl.nixl_agent.__module__].nixlBind
    real = bindings.nixlAgent

    def paced(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = pause_us
        return real(agent_name, agent_config)

    bindings.nixlAgent = paced
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bindings.nixlAgent = real


class NixlEndpoint:
    """This worker's NIXL agent with its KV pool registered; reads from peers' pools."""

    def __init__(
        self, nixl: Any, tensor: torch.Tensor, role: str, progress_pause_us: int = DEFAULT_PROGRESS_PAUSE_US
    ) -> None:
        for k, v in _UCX_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self.name = f"kvmesh-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tensor = tensor  # kept alive: NIXL holds its address
        self.region = PoolRegion.of(tensor)
        config = nixl.nixl_agent_config(
            backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT, enable_prog_thread=True
        )
        self.agent = _agent_with_paced_progress(nixl, self.name, config, progress_pause_us)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL's UCX backend did not start")
        self._registered = [self.agent.register_memory(tensor)]
        self._staging: list[torch.Tensor] = []  # kept alive while registered
        self._peers: dict[str, _Peer] = {}

    def register_staging(self, tensor: torch.Tensor) -> PoolRegion:
        """Register ``tensor``, shaped like a pool, as a place READs may land in (``post``'s ``into``):
        blocks staged there before they are copied into the pool (``kvmesh.worker.rank_nixl``)."""
        self._registered.append(self.agent.register_memory(tensor))
        self._staging.append(tensor)
        return PoolRegion.of(tensor)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def add_peer(self, metadata: bytes, region: PoolRegion) -> str:
        """Load a peer's metadata (from its handshake); returns its agent name."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = _Peer(name, region)
        return name

    def peer_region(self, agent_name: str) -> PoolRegion:
        """The pool a peer shook hands with (NotFound before its handshake)."""
        peer = self._peers.get(agent_name)
        if peer is None:
            raise NotFound(f"no NIXL peer {agent_name!r}: it has not shaken hands with this worker")
        return peer.region

    def forget_peer(self, agent_name: str) -> None:
        if self._peers.pop(agent_name, None) is not None:
            self.agent.remove_remote_agent(agent_name)

    def post(
        self,
        op: str,
        agent_name: str,
        remote_blocks: list[int],
        local_blocks: list[int],
        into: PoolRegion | None = None,
    ) -> NixlRead:
        """Post one ``op`` ("READ": peer's blocks into ours, "WRITE": ours into the peer's) of whole
        blocks, ours in the pool or in a staging area (``into``, from ``register_staging``). Over
        shared memory UCX copies inside this call (it releases the GIL): call it off the event loop."""
        peer, local = self.peer_region(agent_name), into or self.region
        if len(remote_blocks) != len(local_blocks):
            raise InvalidArgument(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones")
        peer.check_blocks(remote_blocks, f"peer {agent_name}'s")
        local.check_blocks(local_blocks, "this worker's")
        if peer.piece_bytes != local.piece_bytes or peer.num_layers != local.num_layers:
            raise Unavailable(f"peer {agent_name} has another block shape")  # the handshake refuses this first
        src, dst, lengths = block_runs(remote_blocks, local_blocks)
        handle = self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(local.run_descs(dst, lengths), local.mem_type),
            self.agent.get_xfer_descs(peer.run_descs(src, lengths), peer.mem_type),
            agent_name,
        )
        read = NixlRead(self.agent, handle, len(local_blocks) * local.block_nbytes)
        try:
            posted = self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: the peer is gone
            posted, reason = "ERR", str(e)
        else:
            reason = "refused"
        if posted == "ERR":
            read._finish()
            raise Unavailable(f"NIXL {op} with {agent_name} could not be posted: {reason}")
        return read

    def notify(self, agent_name: str, message: bytes) -> None:
        """A one-way message to a peer (it finds it in ``notifications``)."""
        try:
            self.agent.send_notif(agent_name, message)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types: the peer went away
            raise Unavailable(f"NIXL notification to {agent_name} failed: {e}") from None

    def notifications(self) -> list[bytes]:
        """Notifications peers' finished READs sent this worker since the last call."""
        return [msg for msgs in self.agent.get_new_notifs().values() for msg in msgs]

    def close(self) -> None:
        for name in list(self._peers):
            self.forget_peer(name)
        for registered in self._registered:
            self.agent.deregister_memory(registered)


class BlockRead:
    """Whole blocks from a peer's pool into ours, in chunks, each chunk's blocks checksummed
    (``on_landed``, on a worker thread: one result per block) as soon as it lands while the next
    is in flight.

    ``run`` returns ``on_landed``'s results in block order (the checksums of what landed, for
    the caller to compare with the holder's before the blocks are used). After ``run`` failed or
    was cancelled, ``settle`` says when no byte can land in the destination blocks any more.
    """

    def __init__(
        self,
        endpoint: NixlEndpoint,
        agent_name: str,
        src: list[int],
        dst: list[int],
        on_landed: Callable[[list[int]], list[Any]],
    ) -> None:
        self._endpoint, self._agent_name = endpoint, agent_name
        self._src, self._dst = src, dst
        self._on_landed = on_landed
        self.nbytes = len(dst) * endpoint.region.block_nbytes
        self._posts: list[asyncio.Future] = []  # each resolves to its posted NixlRead (and results)

    async def run(self, timeout_s: float) -> list[Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        chunks = max(1, min(_MAX_READ_CHUNKS, self.nbytes // _READ_CHUNK_BYTES))
        step = -(-len(self._dst) // chunks)
        posting = asyncio.Semaphore(_POSTS_IN_FLIGHT)

        async def chunk(src: list[int], dst: list[int]) -> list[Any]:
            await posting.acquire()
            posted = functools.partial(loop.call_soon_threadsafe, posting.release)
            # A future of its own, so a cancelled run still finds (and settles) what was posted.
            post = asyncio.ensure_future(asyncio.to_thread(self._post_then_land, src, dst, posted))
            self._posts.append(post)
            read, landed = await asyncio.shield(post)
            if landed is None:  # still in flight (TCP): wait for it here, then verify
                landed = await self._land(read, dst, deadline)
            return landed

        tasks = [
            asyncio.ensure_future(chunk(self._src[lo : lo + step], self._dst[lo : lo + step]))
            for lo in range(0, len(self._dst), step)
        ]
        try:
            parts = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return [result for part in parts for result in part]

    def _post_then_land(
        self, src: list[int], dst: list[int], posted: Callable[[], Any]
    ) -> tuple[NixlRead, list[Any] | None]:
        """On a worker thread: post one chunk (``posted`` lets the next chunk post); if it landed
        inside the post, its results too."""
        try:
            read = self._endpoint.post("READ", self._agent_name, src, dst)
        finally:
            posted()
        try:
            landed = read.done()
        except Unavailable:
            return read, None  # ``_land`` raises it
        return read, self._on_landed(dst) if landed else None

    async def _land(self, read: NixlRead, dst: list[int], deadline: float) -> list[Any]:
        await read.wait(deadline - asyncio.get_running_loop().time())
        return await asyncio.to_thread(self._on_landed, dst)

    async def settle(self, timeout_s: float) -> bool:
        """True once every posted chunk is done, failed or cancelled."""
        settled = True
        for post in self._posts:
            try:
                read, _ = await post
            except Exception:  # noqa: BLE001 - a post that failed left nothing in flight
                continue
            settled = await read.settle(timeout_s) and settled
        return settled
