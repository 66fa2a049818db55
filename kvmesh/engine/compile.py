"""torch.compile (inductor) of the decode step, with shapes that do not recompile per step.

What is compiled: the model's step (embedding, every layer, final norm, LM head) on the
decode path only (decodes, and verify steps laid out as decodes: ``step_metadata``), as one
graph per step. Decode is where a step is many small ops between
the matmuls (norms, RoPE, SiLU, residual adds, dtype casts) and per-op dispatch is a large
share of it; inductor fuses those, and one graph per step pays dynamo's entry cost once, not
per layer. Prefill/extend steps are matmul-bound and their batched attention branches on the
batch's contents, so they stay eager.

The KV write is traced as an index_put_ on the whole pool (``_traced_write``): written
through a view of the pool, as the eager op does, it is functionalized into a copy of the
whole pool per layer.

Why shapes stay dynamic: a decode step's sequence count and block-table width change every
step. ``dynamic=True`` makes them symbolic, except that dynamo specializes size 1: the
engine pads block tables to at least 2 columns, and the warm-up runs a forward of 1 row, of
2 rows (the few-rows graph, where there is one) and of more, on one sequence's 3 free pool
blocks (their KV is overwritten before anything reads it), so every graph exists before the
first request and no later step compiles.

Across tensor-parallel ranks, each rank compiles its own graphs, with the all-reduce an opaque op in
them (``kvmesh.engine.traced_all_reduce``), and warms them up alone (``TensorParallelGroup.compile_decode``).
"""

from __future__ import annotations

import functools
import itertools
import time
import types
from collections.abc import Callable, Mapping

import structlog
import torch
from torch.fx.experimental import _config as fx_config

from kernels import Ops
from kernels.small_rows_linear import one_row_runs_reordered, streamed_rows
from kvmesh.engine.compile_cache import compile_cache, compile_key, compiled_graph_counts
from kvmesh.engine.model import AttentionMetadata, CausalLM
from kvmesh.engine.synthetic_step import synthetic_step
from kvmesh.engine.traced_all_reduce import failures_as_raised

log = structlog.get_logger(__name__)

# Graphs one warmed-up engine holds (one sequence; symbolic), with room to spare; past it
# dynamo would run eagerly.
_GRAPH_LIMIT = 8


def _traced_write(
    ops: Ops, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """``kernels.reference.write_kv_cache`` into layer ``layer``, as index_put_ on the pool itself.

    Same layout and semantics, except that there is no padding slot (-1): the engine never
    schedules one. Written on the pool (not a view of it) so inductor fuses every layer's
    write into the graph in place: an in-place write into a view of a graph input is
    functionalized into a copy of the whole pool per layer.
    """
    block_size = kv_cache.shape[3]
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    which = torch.full_like(slot_mapping, layer)
    kv_cache.index_put_((which, torch.zeros_like(slot_mapping), block, offset), k.to(kv_cache.dtype))
    if kv_cache.shape[1] > 1:  # MLA's latent pool holds no V
        kv_cache.index_put_((which, torch.ones_like(slot_mapping), block, offset), v.to(kv_cache.dtype))


class CompiledDecode:
    """A decode step through one of three compiled graphs of ``model.run``: one row, a few, or many.

    The batched graph is compiled with inductor's freezing: the weights become constants,
    prepacked for oneDNN/MKL (bf16 on AMX); at 16 sequences a step runs 1.1x (fp32) to 1.2x
    (bf16) faster. The one-sequence graph is frozen too in bf16 (42.6 vs 40.0 tok/s alone, 4
    alternating passes of 128 tokens, each faster), and in float32 where one row runs faster on
    oneDNN's reordered weights than on MKL (``kernels.small_rows_linear``, calibrated at load).
    There its row count is kept symbolic (``mark_rows_unbacked``): inductor packs a float32 weight for
    oneDNN only when the rows are symbolic, and sends a static row to MKL's slow one-row path.
    Unbacked, not just dynamic, because dynamo specializes a backed size of 1, and an unbacked
    size packs for many rows, which ran 121 one-row SmolLM2 products in 15.8 ms against 19.6 ms
    packed for one row. On Zen 5, SmolLM2 alone: 1.05x and 1.09x (paired medians of 6
    alternating passes of 128 tokens, in one process) over the same graph calling the reordered
    weights through a Python custom op; 22 tok/s where one row ran on MKL, ~60 this way.
    Elsewhere (floor above 1) the float32 one-sequence graph is not frozen: a packed MKL GEMV
    measured ~5% slower than the plain one.

    A third graph takes steps of 2 to ``few_rows`` rows (a verify of a few drafts, a few
    sequences' decodes), the most rows the small-row linears stream: its rows are symbolic with
    that range, so each product in it calls ``streamed_mm`` as eager does. In the batched
    graph a verify of 3-4 drafts had run on MKL (SmolLM2 fp32, one sequence: 2.09 / 2.23
    decodes, against 1.21 / 1.33 for 1 / 2 drafts).

    The graphs skip dynamo's guards on the model's modules (checking ~270 parameters took
    ~0.6 ms a step): nothing changes the model once compiled. That is only safe while a graph
    can never be looked up for another model, and dynamo keeps its graphs per code object, so
    each instance compiles functions with code objects of its own (``_own_code``).
    """

    def __init__(self, model: CausalLM) -> None:
        skip = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.alone = torch.compile(_own_code(_run), dynamic=True, options=skip)
        self.few = torch.compile(_own_code(_run), dynamic=True, options=skip)
        self.batched = torch.compile(_own_code(_run), dynamic=True, options=skip)
        self.model = model
        # Steps of 2 to this many rows run the few-rows graph (0: none); set by compile_decode.
        self.few_rows = 0
        # Set by compile_decode only while the one-sequence graph compiles: once built, an
        # unbacked graph takes one row unmarked, and marking costs time on every step
        # (docs/measurements.md).
        self.mark_rows_unbacked = False
        # Likewise while the few-rows graph compiles: its rows get the range 2..few_rows.
        self.mark_few_rows = False
        # Once built, whether a step no graph fits runs eager instead of compiling one (compile_decode).
        self.eager_on_recompile = False

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_idx: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = (input_ids, positions, meta.slot_mapping, logits_idx)
        if 1 < input_ids.shape[0] <= self.few_rows:
            if self.mark_few_rows:
                for t in rows:
                    torch._dynamo.mark_dynamic(t, 0, min=2, max=self.few_rows)
            graph = self.few
        elif input_ids.shape[0] > 1:
            graph = self.batched
        else:
            if self.mark_rows_unbacked:
                for t in rows:
                    torch._dynamo.decorators.mark_unbacked(t, 0)
            graph = self.alone
        with failures_as_raised():  # a tensor-parallel rank lost mid-graph is RankLost, as in an eager step
            if self.eager_on_recompile:
                with torch.compiler.set_stance("eager_on_recompile"):
                    return graph(self.model, input_ids, positions, kv_cache, meta, logits_idx)
            return graph(self.model, input_ids, positions, kv_cache, meta, logits_idx)


def _run(model: CausalLM, *args) -> tuple[torch.Tensor, torch.Tensor]:
    return model.run(*args)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a copy of its code object: a dynamo graph cache (and guards) of its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def compile_decode(
    model: CausalLM, kv_cache: torch.Tensor, settings: Mapping[str, object], recompile: bool = True
) -> None:
    """Route ``model``'s decode steps through compiled graphs and build them now, or load them from
    the compile cache's folder for ``settings`` and this toolchain (``kvmesh.engine.compile_cache``).

    Without ``recompile``, a later step that no graph fits runs eager rather than compiling: a
    tensor-parallel rank compiling mid-step (minutes on CPU) would leave the others waiting in an
    all-reduce past its timeout."""
    # The graphs follow what this process's small-row linears calibrated (a timing, which can differ from
    # one start to the next): the few-rows graph's range, and whether one row's product is reordered. A
    # graph cached under other figures would bring guards that contradict this process's ranges.
    calibrated = {"streamed_rows": streamed_rows(model), "one_row_reordered": one_row_runs_reordered(model)}
    with compile_cache(compile_key({**settings, **calibrated})):
        _compile_decode(model, kv_cache)
    model.compiled_decode.eager_on_recompile = not recompile


def _compile_decode(model: CausalLM, kv_cache: torch.Tensor) -> None:
    # Imported only when compiling: with inductor imported at engine import, the Triton kernel
    # tests later in the same pytest process failed (tl.cdiv stayed a JITFunction under the interpreter).
    from torch._inductor import config as inductor_config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _GRAPH_LIMIT)
    model.write_kv = _traced_write
    reordered_alone = kv_cache.dtype == torch.float32 and one_row_runs_reordered(model)
    compiled = model.compiled_decode = CompiledDecode(model)
    torch._dynamo.mark_static(kv_cache)  # the pool's shape never changes
    # Sizes become symbols here. Without duck shaping, two sizes that happen to be equal in the
    # warm-up (batch and width, or either and a model dimension) do not become one symbol.
    # cpp_wrapper: the graph's calls between kernels run in generated C++, not Python, which saves
    # a step the Python calls' time (docs/measurements.md).
    # The graphs of one row and of a few: frozen in bf16 and where one float32 row runs reordered.
    freeze_small = kv_cache.dtype == torch.bfloat16 or reordered_alone
    # One sequence on 3 free pool blocks; new_tokens picks the graph (1, 2..few_rows, more rows).
    step = functools.partial(synthetic_step, model, kv_cache, batch=1, width=3, seq_len=3 * kv_cache.shape[3])
    graphs = 3 if streamed_rows(model) >= 2 else 2
    built = itertools.count(1)

    def warm_up(new_tokens: int, rows: str) -> None:
        before, start = compiled_graph_counts(), time.perf_counter()
        log.info(f"compiling decode graph {next(built)}/{graphs} ({rows})")
        step(new_tokens=new_tokens)
        after = compiled_graph_counts()
        log.info(
            "decode graph ready",
            seconds=round(time.perf_counter() - start, 1),
            **{k: after[k] - before[k] for k in after},
        )

    with fx_config.patch(use_duck_shape=False), inductor_config.patch(cpp_wrapper=True):
        with inductor_config.patch(freezing=freeze_small):
            compiled.mark_rows_unbacked = reordered_alone
            warm_up(1, "one sequence")
            compiled.mark_rows_unbacked = False
            compiled.few_rows = streamed_rows(model)
            if compiled.few_rows >= 2:
                compiled.mark_few_rows = True
                warm_up(2, f"2 to {compiled.few_rows} rows")
                compiled.mark_few_rows = False
        with inductor_config.patch(freezing=True):
            warm_up(max(2, compiled.few_rows + 1), "batched")
