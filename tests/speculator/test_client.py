"""SpeculatorProposer, the decode worker's side, against the real service in-process.

``propose`` is called the way the engine calls it: synchronously, from a
thread other than the event loop's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.engine.sequence import Sequence, Status
from kvmesh.sampling import SamplingParams
from services.speculator.client import SpeculatorProposer
from tests.service_helpers import free_port

from .conftest import HANG_GUARD_S, connected, eventually, proposer_for, server_stats, speculator_on

LOOP = [21, 22, 23, 24, 25, 26, 27]


async def propose(proposer: SpeculatorProposer, *wants: tuple[Sequence, int]) -> dict[str, list[int]]:
    return await asyncio.to_thread(proposer.propose, list(wants))


def sequence(request_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=100))
    seq.status = Status.RUNNING
    return seq


def counter(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


async def test_drafts_arrive_and_updates_carry_only_new_tokens():
    port = free_port()
    async with speculator_on(port), proposer_for(port) as (proposer, registry):
        await connected(proposer)
        a = sequence("a", [1, 2] + LOOP + LOOP[:3])
        b = sequence("b", [40, 41, 42, 43, 40, 41])
        assert await propose(proposer, (a, 4), (b, 2)) == {"a": LOOP[3:7], "b": [42, 43]}

        # The decode step accepted 3 of a's drafts and sampled one more token.
        a.output_ids += LOOP[3:7]
        a.num_draft_accepted += 3
        b.output_ids += [42]
        assert await propose(proposer, (a, 3), (b, 2)) == {"a": [LOOP[0], LOOP[1], LOOP[2]], "b": [43, 40]}
        st = await server_stats(port)
        assert (st.proposed_tokens, st.accepted_tokens, st.active_requests) == (4 + 2 + 3 + 2, 3, 2)
        assert counter(registry, "kvmesh_speculator_client_draft_tokens_total") == 11
        assert counter(registry, "kvmesh_speculator_client_late_updates_total") == 0


async def test_finished_sequences_teach_later_requests():
    port = free_port()
    async with speculator_on(port), proposer_for(port) as (proposer, _):
        await connected(proposer)
        first = sequence("first", list(range(300, 330)))
        assert await propose(proposer, (first, 4)) == {}
        first.output_ids += list(range(330, 350))
        first.num_draft_accepted = 0
        first.status, first.finish_reason = Status.FINISHED, "length"
        proposer.finished(first)  # sends the last 20 tokens, then learns all 50

        async def learned() -> bool:
            st = await server_stats(port)
            return st.indexed_tokens == 50 and st.active_requests == 0

        await eventually(learned)
        second = sequence("second", [5, 5] + list(range(320, 336)))
        assert await propose(proposer, (second, 6)) == {"second": list(range(336, 342))}


async def test_a_sequence_the_engine_aborted_is_dropped_on_the_next_step():
    port = free_port()
    async with speculator_on(port), proposer_for(port) as (proposer, _):
        await connected(proposer)
        gone, alive = sequence("gone", LOOP * 2), sequence("alive", LOOP * 2)
        await propose(proposer, (gone, 2), (alive, 2))
        assert (await server_stats(port)).active_requests == 2
        gone.status, gone.finish_reason = Status.FINISHED, "abort"  # engine.abort: no finished() call
        await propose(proposer, (alive, 2))

        async def one_left() -> bool:
            st = await server_stats(port)
            return st.active_requests == 1 and st.indexed_tokens == 0

        await eventually(one_left)


async def test_with_the_speculator_down_propose_returns_nothing_without_waiting():
    port = free_port()  # nothing listens here
    async with proposer_for(port) as (proposer, registry):
        seq = sequence("r", LOOP * 3)
        assert await propose(proposer, (seq, 4)) == {}
        assert counter(registry, "kvmesh_speculator_client_offline_steps_total") == 1
        # It returned at once: no step waited out its budget for an answer.
        assert counter(registry, "kvmesh_speculator_client_late_updates_total") == 0

        async def failed() -> bool:
            return counter(registry, "kvmesh_speculator_client_connect_failures_total") >= 2

        await eventually(failed)  # it keeps trying, with backoff
        assert registry.get_sample_value("kvmesh_speculator_client_connected") == 0
        proposer.finished(seq)  # also harmless while down


async def test_reconnects_after_the_speculator_restarts_and_resends_whole_contexts():
    port = free_port()
    seq = sequence("r", [3, 3] + LOOP + LOOP[:2])
    async with proposer_for(port) as (proposer, registry):
        async with speculator_on(port):
            await connected(proposer)
            assert await propose(proposer, (seq, 3)) == {"r": LOOP[2:5]}

        # Stopped: the stream ends, and steps run without drafts.
        async def down() -> bool:
            return not proposer.connected

        await eventually(down)
        seq.output_ids += LOOP[2:4]
        assert await propose(proposer, (seq, 3)) == {}

        async with speculator_on(port):
            await connected(proposer)
            seq.output_ids += LOOP[4:5]
            # The new speculator knows nothing of the old stream: it gets the whole context.
            assert await propose(proposer, (seq, 3)) == {"r": [LOOP[5], LOOP[6], LOOP[0]]}
            assert (await server_stats(port)).active_requests == 1
        assert counter(registry, "kvmesh_speculator_client_late_updates_total") == 0


async def test_a_killed_speculator_process_costs_drafts_only():
    """SIGKILL: no drain, the connection just drops. Steps go on without drafts, and a new
    speculator process is picked up."""
    port = free_port()
    argv = [sys.executable, "-m", "services.speculator.main", "--port", str(port), "--metrics-port", "0"]
    seq = sequence("r", LOOP * 2)
    async with proposer_for(port) as (proposer, registry):
        first = subprocess.Popen(argv)
        try:
            await connected(proposer)
            assert await propose(proposer, (seq, 2)) == {"r": LOOP[:2]}
        finally:
            first.kill()
            first.wait()

        async def down() -> bool:
            return not proposer.connected

        await eventually(down)
        assert await propose(proposer, (seq, 2)) == {}
        second = subprocess.Popen(argv)
        try:
            await connected(proposer)
            assert await propose(proposer, (seq, 2)) == {"r": LOOP[:2]}
        finally:
            second.terminate()
            assert second.wait(HANG_GUARD_S) == 0  # a graceful stop, even with our stream open
        assert counter(registry, "kvmesh_speculator_client_late_updates_total") == 0


async def test_answers_that_miss_the_budget_are_dropped():
    port = free_port()
    async with speculator_on(port), proposer_for(port, budget_ms=50) as (proposer, registry):
        await connected(proposer)
        seq = sequence("r", LOOP * 2)
        drafts: dict = {}
        step_over = threading.Event()

        def engine_step() -> None:
            drafts.update(proposer.propose([(seq, 2)]))
            step_over.set()

        # Stall the event loop (which carries the stream) until the step has given up waiting.
        asyncio.get_running_loop().call_soon(step_over.wait, HANG_GUARD_S)
        threading.Thread(target=engine_step).start()
        await asyncio.sleep(0)
        assert step_over.is_set() and drafts == {}
        assert counter(registry, "kvmesh_speculator_client_late_updates_total") == 1
        # The late answer (for the old context length) never lands on a later step. A step may
        # itself miss the 50 ms budget on a loaded machine (an empty answer): then the next one.
        seq.output_ids += LOOP[:2]
        answers = []
        while not answers or (answers[-1] == {} and len(answers) < 20):
            answers.append(await propose(proposer, (seq, 2)))
        assert answers[-1] == {"r": LOOP[2:4]} and all(a == {} for a in answers[:-1])


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget"):
        SpeculatorProposer("127.0.0.1:1", budget_ms=0)
