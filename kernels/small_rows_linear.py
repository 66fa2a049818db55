"""CPU linear layers whose few-row products run on a oneDNN-reordered copy of the weight.

float32: up to 3 rows, MKL runs at memory speed. From 4 rows on (a speculative verify of
3 or 4 drafts: k+1 rows per sequence) it takes its GEMM path, which repacks the weight on
every call. On the 2-core dev machine (SmolLM2-135M, one sequence), a step took 34.8 ms
with 1 row, 41.0 / 42.1 ms with 2 / 3 rows, then 57.3 / 58.9 ms with 4 / 5 rows. With
each weight reordered once for oneDNN, the 4- and 5-row steps take 51.1 / 52.8 ms.
oneDNN is slower below 4 rows (50 ms), so those stay on the plain weight.

bfloat16: the plain product reorders the weight for AMX on every call from 2 rows on.
The model's linears (LM head included) took 21.5 ms for 1 row and 28.7-29.9 ms for 2 to
16 rows; on reordered weights 19.6 ms for 1 row and 18.1-20.3 ms for 2 to 16 rows. So
every small product runs on the reordered weight, and a verify of k drafts costs about
what one decode row does.

Products of more than ``max_rows`` rows (prefill chunks) stay on the plain weight: no
gain was measured at 128 or 512 rows (float32).

Which float32 path wins below 4 rows depends on the processor: on a 2-core AMD EPYC
(Zen 5, no AMX) the model's linears took 35.7 / 58.5 / 74.5 ms for 1 / 2 / 3 rows with
MKL and 17.7 / 19.0 / 12.7 ms on the reordered weights, the reverse of the numbers above.
So ``use_small_rows_linears`` times both paths on the model's own weights at 1 to 3 rows
once, at load, and moves the floor down where the reordered weight wins
(``fewest_rows_that_pay``).

Fewer rows still can run on neither library: kernels.cpu's ``streamed_mm`` streams the plain
weight through float32 FMAs (AVX-512), which on a 2-core Xeon without AVX-512 BF16 or AMX
read a bf16 weight at 13.9 GB/s where torch's products read 9.3 (plain) or 7.8 (reordered);
SmolLM2 in bf16 decoded one sequence at 35.2 tok/s against 23.9 (medians of 4 alternating
runs). On a 2-core Xeon with AMX it still won: bf16 39.5 against 33.2 tok/s eager, 59.9 against
51.0 compiled; float32 tied (30.8 / 30.4 eager), both at memory speed on two threads, though
one thread's 2-6-row products (a verify) streamed 10-20% faster. Where it wins depends on the
processor again (AMX, MKL's kernels), so
``calibrate_streamed_rows`` times it against each module's own path at 1 to
``STREAMED_ROWS_TRIED`` rows at load, and products of up to the count where it kept winning
stream (``SmallRowsLinear.streamed_rows``).

Costs a second, reordered copy of every weight. A CPU engine swaps these in by default
(``EngineConfig.small_rows_linears``): on that Zen 5 machine, SmolLM2 in float32 decoded
18.9 -> 41.3 tok/s alone and 136 -> 359 tok/s 16 at once (bench/engine.py, one run each).
Inside a compiled graph every product is traced as the plain one, and inductor's freezing
prepacks the weights itself: bf16 for oneDNN (AMX where there is one), float32 for oneDNN
where the graph's row count is symbolic and for MKL where it is a static one. A one-sequence
decode graph has one row, static unless marked otherwise, and MKL's one-row product is the
slow one on Zen 5: ``kvmesh.engine.compile`` keeps that graph's rows symbolic wherever one
row runs faster reordered (``one_row_runs_reordered``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

import kernels.cpu as kernels_cpu
from kernels.errors import KernelUnavailable
from kernels.module_swap import swap_modules

_log = logging.getLogger(__name__)

# The fewest rows that run on the reordered weight, per dtype (the module's docstring says why);
# for float32, where no calibration has moved it down (``calibrate_min_rows``).
MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}
# More rows are prefill-sized, where the plain GEMM is as fast.
DEFAULT_MAX_ROWS = 64
# Shape the reorder is tuned for: a verify of 4 drafts plus the bonus row.
_REORDER_ROWS_HINT = 5
# The most rows ``calibrate_streamed_rows`` tries streaming: a verify of 5 drafts and its bonus
# row, one pass of streamed_mm's loop.
STREAMED_ROWS_TRIED = 6


@functools.cache
def reorder_unavailable(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot reorder a ``dtype`` weight on this CPU (None: it can). bfloat16 needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT: on a plain AVX2 machine those linears stay ``nn.Linear``."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _REORDER_ROWS_HINT)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def small_rows_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes whose linears this CPU can run on a reordered weight."""
    return frozenset(d for d in MIN_ROWS if reorder_unavailable(d) is None)


def _reordered_product(rows: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of 2-D ``rows`` with a ``_reorder_linear_weight`` weight, no fused activation."""
    return torch.ops.mkldnn._linear_pointwise(rows, reordered, bias, "none", [], "")


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight``/``bias`` parameters, shared, not copied) that runs its
    ``MIN_ROWS``..``max_rows``-row products through oneDNN on a reordered copy of the weight."""

    def __init__(
        self, weight: nn.Parameter | torch.Tensor, bias: torch.Tensor | None, max_rows: int = DEFAULT_MAX_ROWS
    ) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate fresh weights
        if weight.device.type != "cpu" or weight.dtype not in MIN_ROWS:
            raise KernelUnavailable("small-row oneDNN linears are for float32 or bfloat16 weights on CPU")
        if (why := reorder_unavailable(weight.dtype)) is not None:
            raise KernelUnavailable(f"small-row oneDNN linears cannot run {weight.dtype} here: {why}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.min_rows, self.max_rows = MIN_ROWS[weight.dtype], max_rows
        # Products of up to this many rows run kernels.cpu's streamed_mm (0: none), where
        # ``calibrate_streamed_rows`` measured it faster.
        self.streamed_rows = 0
        # A plain attribute, not a buffer: it is no part of the state dict.
        self._reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _REORDER_ROWS_HINT)

    @classmethod
    def of(cls, linear: nn.Linear, max_rows: int = DEFAULT_MAX_ROWS) -> SmallRowsLinear:
        return cls(linear.weight, linear.bias, max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        # A static row count (eager, or a graph traced for one row) can stream. A symbolic one
        # (a graph for any batch) does not: testing it would add a guard, and a graph per side
        # of it (an unbacked one cannot be tested at all).
        # streamed_rows 0 streams nothing, not even a product of no rows (a prefill chunk that samples none).
        if self.streamed_rows and statically_known_true(n <= self.streamed_rows) and not torch.is_grad_enabled():
            return torch.ops.kvmesh_cpu.streamed_mm(rows.contiguous(), self.weight, self.bias).view(
                *x.shape[:-1], self.out_features
            )
        # A graph being traced takes the plain product: inductor packs the weights itself (module docstring).
        if torch.compiler.is_compiling() or not self.min_rows <= n <= self.max_rows or torch.is_grad_enabled():
            return super().forward(x)
        return _reordered_product(rows.contiguous(), self._reordered, self.bias).view(*x.shape[:-1], self.out_features)


def one_row_runs_reordered(model: nn.Module) -> bool:
    """Whether ``model`` runs a float32 product of one row on the reordered weights (its
    small-row linears' calibrated floor is 1, and one row does not stream)."""
    return any(
        isinstance(m, SmallRowsLinear) and m.weight.dtype == torch.float32 and m.min_rows <= 1 and m.streamed_rows < 1
        for m in model.modules()
    )


def streamed_rows(model: nn.Module) -> int:
    """The most rows every small-row linear of ``model`` streams (0: one of them, or none, does not)."""
    counts = [m.streamed_rows for m in model.modules() if isinstance(m, SmallRowsLinear)]
    return min(counts, default=0)


def use_small_rows_linears(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS, calibrate: bool = True) -> int:
    """Swap, in place, every float32 or bfloat16 CPU ``nn.Linear`` of ``model`` for a
    ``SmallRowsLinear`` (sharing its parameters); returns how many were swapped. With
    ``calibrate``, the float32 ones get the row floor this processor pays at (``calibrate_min_rows``),
    and each dtype's the rows it streams (``calibrate_streamed_rows``)."""
    swapped = swap_modules(
        model,
        lambda name, m: (
            type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in small_rows_dtypes()
        ),
        lambda linear: SmallRowsLinear.of(linear, max_rows),
    )
    fp32 = [m for m in model.modules() if isinstance(m, SmallRowsLinear) and m.weight.dtype == torch.float32]
    if calibrate and fp32:
        calibrate_min_rows(fp32)
    if calibrate:
        for dtype in MIN_ROWS:
            same_dtype = [m for m in model.modules() if isinstance(m, SmallRowsLinear) and m.weight.dtype == dtype]
            if same_dtype:
                calibrate_streamed_rows(same_dtype)
    return swapped


def fewest_rows_that_pay(plain_s: dict[int, float], reordered_s: dict[int, float], default: int) -> int:
    """The smallest row count r below ``default`` from which the reordered weight was faster at
    every measured count up to ``default`` - 1 (``default`` when it never was)."""
    floor = default
    for rows in sorted((r for r in plain_s if r < default), reverse=True):
        if reordered_s[rows] >= plain_s[rows]:
            break
        floor = rows
    return floor


def calibrate_min_rows(modules: list[SmallRowsLinear], repeats: int = 6) -> int:
    """Time one pass of 1, 2, ... MIN_ROWS - 1 rows through every module, on the plain weight and
    on the reordered one (the weights stream from memory as in a decode step), and give all of
    them the floor ``fewest_rows_that_pay`` picks. Returns it.

    Timed on one thread, the two paths taking turns pass by pass, each keeping its fastest of
    ``repeats``. A worker calibrates while the mesh's other processes start beside it: in a
    colocated float32 mesh on 2 cores, prefill and decode calibrated at the same moment, each on
    2 threads; oneDNN's threads waited on each other's time slices (a reordered pass took
    900 ms, against 15 ms alone) while MKL's one-row product, single-threaded, did not (37 ms),
    so decode kept MKL for one row and streamed one HTTP request at 21-23 tok/s, where the same
    engine alone ran 48. One thread compares the kernels, not the scheduler; taking turns puts
    load that comes and goes on both paths alike."""
    default = MIN_ROWS[torch.float32]
    plain_s, reordered_s = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows in range(1, default):
                xs = [torch.randn(rows, m.in_features) for m in modules]
                plain_s[rows], reordered_s[rows] = fastest_alternating(
                    repeats,
                    (
                        lambda: [nn.functional.linear(x, m.weight, m.bias) for x, m in zip(xs, modules)],
                        lambda: [_reordered_product(x, m._reordered, m.bias) for x, m in zip(xs, modules)],
                    ),
                )
    finally:
        torch.set_num_threads(threads)
    floor = fewest_rows_that_pay(plain_s, reordered_s, default)
    for m in modules:
        m.min_rows = floor
    _log.info(
        "small-row linears: float32 products of %d to %d rows run on the reordered weights "
        "(ms per pass, plain vs reordered: %s)",
        floor,
        modules[0].max_rows,
        {r: (round(plain_s[r] * 1e3, 1), round(reordered_s[r] * 1e3, 1)) for r in plain_s},
    )
    return floor


def most_rows_that_stream(own_s: dict[int, float], streamed_s: dict[int, float]) -> int:
    """The largest row count r such that the streamed product was faster at every measured
    count from 1 to r (0 when it was not faster at one row)."""
    most = 0
    for rows in sorted(own_s):
        if streamed_s[rows] >= own_s[rows]:
            break
        most = rows
    return most


def calibrate_streamed_rows(modules: list[SmallRowsLinear], repeats: int = 6) -> int:
    """Time one pass of 1 to ``STREAMED_ROWS_TRIED`` rows through every module (all of one dtype),
    on the path each would otherwise take and on kernels.cpu's ``streamed_mm``, and give all of
    them the most rows ``most_rows_that_stream`` picks (0 where the native kernels cannot run).
    Returns it. Timed as ``calibrate_min_rows`` times, for the same reasons: one thread, the
    paths taking turns, the fastest of ``repeats`` each.

    The path compared against is the eager one. It stands in for a compiled decode graph's
    product too: inductor prepacks the weight for the same libraries (oneDNN for bf16, MKL for a
    float32 graph of one row), and a graph traced with a row count that streams calls
    ``streamed_mm`` itself."""
    try:
        kernels_cpu.load()
    except KernelUnavailable as exc:
        _log.info("small-row linears: no streamed products (%s)", exc)
        return 0
    for m in modules:
        m.streamed_rows = 0  # each module's own path, while it is timed
    own_s, streamed_s = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows in range(1, STREAMED_ROWS_TRIED + 1):
                xs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in modules]
                own_s[rows], streamed_s[rows] = fastest_alternating(
                    repeats,
                    (
                        lambda: [m(x) for x, m in zip(xs, modules)],
                        lambda: [torch.ops.kvmesh_cpu.streamed_mm(x, m.weight, m.bias) for x, m in zip(xs, modules)],
                    ),
                )
    finally:
        torch.set_num_threads(threads)
    most = most_rows_that_stream(own_s, streamed_s)
    for m in modules:
        m.streamed_rows = most
    _log.info(
        "small-row linears: %s products of up to %d rows stream (ms per pass, own path vs streamed: %s)",
        modules[0].weight.dtype,
        most,
        {r: (round(own_s[r] * 1e3, 1), round(streamed_s[r] * 1e3, 1)) for r in own_s},
    )
    return most


def fastest_alternating(repeats: int, fns: tuple[Callable[[], object], ...]) -> tuple[float, ...]:
    """The fastest of ``repeats`` timed calls of each of ``fns``, called in turn (after one
    untimed call each), so that load that comes and goes falls on all of them alike."""
    for fn in fns:
        fn()  # first touch: allocations, oneDNN primitive creation
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return tuple(best)


def best_seconds(repeats: int, fn: Callable[[], object]) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call."""
    return fastest_alternating(repeats, (fn,))[0]
