"""A probe, not used by the runtime: a chain of FP8 block-scaled linears for a few rows in ONE persistent
launch, with `linear_fp8`'s loop and bits: y_0 = L_0(x), y_{l+1} = L_{l+1}(y_l[:, :G K]).

Answered 2026-12-06 on one H100 (docs/PERFORMANCE.md, "2026-12-06 from 15:58 UTC"): no gain. As the
step's wo_a -> wo_b at one row (fast.WO_CHAIN_ROWS, built, bit-identical, removed: read it at e55fad6)
the chain took 35.1 us against 34.1 for the two linear_fp8 launches with 4 programs per SM (the 16-layer
step +1.0 % at 1 row, +7 % at 2 rows) and 41.1 us with 2 (+3.6 %); bare (chain_probe.py --tchain) every
program-count was slower than linear_fp8's launches, by as much as its programs in flight were fewer.

Shapes and dtypes (M <= 16 rows): x [M, G_0 K_0] bf16 / fp32; layer l: w e4m3 [N_l, K_l], scale e8m0
[N_l / 128, K_l / 128], G_l groups (output rows [g N/G, (g + 1) N/G) read input columns [g K, (g + 1) K),
as `linear_fp8(groups=)`), the activation quantized or not (`quantize_act`), y_l [M, N_l] in its
out_dtype. `linear_chain_ref` is the same chain through `linear_fp8_ref`.

Why one launch: at one row each 33.6 MB FP8 stream of the step costs ~5.8 us + bytes / 4.0 TB/s on the
H200 (docs/PERFORMANCE.md, 2026-12-06 from 13:33 UTC): the loop streams near the read and ~6 us goes at
each launch boundary (ramp, tail, split-K sum). Here a program that finishes its items of one layer
starts the next layer's as soon as their input exists, and asks L2 for their weights before it waits.

The work: a layer's items are (row tile of BLOCK_N = 64 outputs, K split) with `linear_fp8.pick_config`'s
split for the shape and its 16-row tile. P programs walk one list of every layer's items round robin
(program p: items p, p + P, ...). An item runs `_linear_fp8_kernel`'s "f16" loop (the same loads,
quantization, `_code_dot`, scale order and epilogue rounding), and the tile's last arriving item sums the
split partials in split order (an arrival counter per tile): every y_l has linear_fp8's bits, at any
M <= 16 (tests/kernels/test_linear_chain.py). Dependencies: an item of layer l + 1 reads one chunk of
y_l (its split's KPS columns in its group); the item that completes a tile of y_l adds one to its chunk's
counter (release), and a consumer polls the counter (acquire) until the chunk's KPS / 64 tiles are in.
Layer l + 1's items are ordered by the chunk they read, so the first need the chunks that complete first.
The last program out resets the chunk counters (tile counters are reset by their last arrivers), so the
next launch, a graph replay included, starts from zero. A wait that polls GIVE_UP times gives up and sets
an error word (`check`) rather than hang: every program must be resident at once, or the stream's other
work must finish and free the SMs (nothing the chain waits for is behind it).

Under the interpreter (CPU tests) programs run one after another, so only one program works there
(`programs=1`: it makes every item in order and never waits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels import linear_fp8 as LIN
from megastep.kernels.common import (
    e8m0_to_f32,
    f16_pow2_scale,
    fp8_pow2_scale,
    fp8_round,
    l2_prefetch_rows,
    launch_opts,
    on_interpreter,
    pdl_enter,
    pdl_release,
    sm_count,
)
from megastep.kernels.spin import wait_ns

BLOCK_N = 64  # linear_fp8's row tile for these shapes (checked against pick_config)
BLOCK_M = 16  # linear_fp8's row tile for M <= 16
MAX_LAYERS = 4
MAX_CHUNKS = 64  # chunk counters per layer
GIVE_UP = tl.constexpr(1 << 22)  # polls of a chunk counter before a wait gives up (~0.5 s or more)
PREFETCH_LINES = 8  # 128-byte lines of each weight row a waiting item asks L2 for (1 KB: a 1024-wide split)
PROGRAMS_PER_SM = 2  # the launch's programs: 2 per SM are resident whatever the register count (<= 255)


@triton.jit
def _item(x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, in_ptr, out_ptr, err_ptr, tile, s, M, stride_x,
          N, K, KPS, GROUP_N, NEXT_KPS, gap_ns, SPLIT_K: tl.constexpr, QUANT: tl.constexpr, WAIT: tl.constexpr,
          SIGNAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, LINES: tl.constexpr,
          INTERPRET: tl.constexpr):
    """One (row tile, K split) of a layer: `_linear_fp8_kernel`'s "f16" loop, split-K sum and plain epilogue."""
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = s * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    x_off = (n0 // GROUP_N) * K  # grouped (wo_a): output rows of group g read input columns [g K, (g + 1) K)
    if WAIT:
        if LINES > 0:
            if not INTERPRET:  # the weights never depend on the wait
                l2_prefetch_rows(w_ptr, n0, N, K, s, KPS, K, BLOCK_N, LINES)
        chunk = (x_off + k_lo) // KPS
        need = KPS // BLOCK_N
        got = tl.atomic_add(in_ptr + chunk, 0, sem="acquire", scope="gpu")
        tries = 0
        while (got < need) & (tries < GIVE_UP):
            got = tl.atomic_add(in_ptr + chunk, 0, sem="acquire", scope="gpu")
            tries += 1
        if got < need:  # a producer never ran: say so rather than hang (this output is wrong)
            tl.atomic_xchg(err_ptr, 1)
        if gap_ns > 0:  # (probes only: a latency-bound stage stood in as a wait)
            if not INTERPRET:
                wait_ns(gap_ns)
        tl.debug_barrier()
    ws_row = ws_ptr + (n0 // 128) * tl.cdiv(K, 128)
    w_rows = w_ptr + offs_n[:, None] * K
    x_rows = x_ptr + x_off + offs_m[:, None] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        # .cg: x may have been written by other SMs during this launch (L1 is not coherent)
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        if QUANT:
            sx, inv = fp8_pow2_scale(tl.max(tl.abs(xt), axis=1))
            q = fp8_round(xt, inv[:, None], INTERPRET)
        else:  # wo_a: the activation itself, scaled into fp16's range
            sx, inv = f16_pow2_scale(tl.max(tl.abs(xt), axis=1))
            q = (xt * inv[:, None]).to(tl.float16)
        acc += LIN._code_dot(w, q, INTERPRET) * (sx * e8m0_to_f32(tl.load(ws_row + k0 // 128)))[None, :]

    OUT_BF16: tl.constexpr = y_ptr.dtype.element_ty == tl.bfloat16
    out_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    done = True
    if SPLIT_K == 1:
        acc = LIN._epilogue(acc, acc, out_ptrs, out_mask, 0.0, OUT_BF16, INTERPRET, False, False, False)
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_elems = BLOCK_N * BLOCK_M
        split_stride = tl.cdiv(N, BLOCK_N) * tile_elems
        p_off = tile * tile_elems + tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(part_ptr + s * split_stride + p_off, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        done = arrived == SPLIT_K - 1
        if done:  # the tile's last item: linear_fp8's fixed-order sum
            tl.debug_barrier()
            tot = tl.load(part_ptr + p_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            for sk in tl.static_range(1, SPLIT_K):
                tot += tl.load(part_ptr + sk * split_stride + p_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            tot = LIN._epilogue(tot, tot, out_ptrs, out_mask, 0.0, OUT_BF16, INTERPRET, False, False, False)
            tl.store(out_ptrs, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + tile, 0)
    if SIGNAL:
        if done:
            tl.debug_barrier()  # every thread's stores of the tile are issued before the release
            tl.atomic_add(out_ptr + n0 // NEXT_KPS, 1, sem="release", scope="gpu")


@triton.jit
def _chain_kernel(
    items_ptr, chunks_ptr, exit_ptr, x_ptr, M, stride_x, total, off1, off2, off3,
    w0, s0, y0, p0, c0, n0, k0, kps0, g0, gap0,
    w1, s1, y1, p1, c1, n1, k1, kps1, g1, gap1,
    w2, s2, y2, p2, c2, n2, k2, kps2, g2, gap2,
    w3, s3, y3, p3, c3, n3, k3, kps3, g3, gap3,
    NL: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, Q3: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LINES: tl.constexpr, MAXC: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    # layer l > 0 waits on counter block l (its chunks of y_{l-1}); layer l < NL - 1 signals block l + 1;
    # exit_ptr: [the programs out, the error word]; y_l's row stride is N_l (layer l + 1's x)
    pdl_enter(PDL)
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    err = exit_ptr + 1
    seen = -1  # the last layer this program waited in (a probe's gap is spun once per layer)
    for j in range(pid, total, P):
        tile = tl.load(items_ptr + 2 * j)
        s = tl.load(items_ptr + 2 * j + 1)
        if j < off1:
            _item(x_ptr, w0, s0, y0, p0, c0, chunks_ptr, chunks_ptr + MAXC, err, tile, s, M, stride_x, n0, k0, kps0,
                  g0, kps1, gap0, S0, Q0, False, NL > 1, BLOCK_N, BLOCK_M, LINES, INTERPRET)
            seen = 0
        elif NL > 1:
            if j < off2:
                _item(y0, w1, s1, y1, p1, c1, chunks_ptr + MAXC, chunks_ptr + 2 * MAXC, err, tile, s, M, n0, n1, k1,
                      kps1, g1, kps2, tl.where(seen < 1, gap1, 0), S1, Q1, True, NL > 2, BLOCK_N, BLOCK_M, LINES,
                      INTERPRET)
                seen = 1
            elif NL > 2:
                if j < off3:
                    _item(y1, w2, s2, y2, p2, c2, chunks_ptr + 2 * MAXC, chunks_ptr + 3 * MAXC, err, tile, s, M, n1,
                          n2, k2, kps2, g2, kps3, tl.where(seen < 2, gap2, 0), S2, Q2, True, NL > 3, BLOCK_N,
                          BLOCK_M, LINES, INTERPRET)
                    seen = 2
                elif NL > 3:
                    _item(y2, w3, s3, y3, p3, c3, chunks_ptr + 3 * MAXC, chunks_ptr + 4 * MAXC, err, tile, s, M, n2,
                          n3, k3, kps3, g3, kps3, tl.where(seen < 3, gap3, 0), S3, Q3, True, False, BLOCK_N,
                          BLOCK_M, LINES, INTERPRET)
                    seen = 3
    pdl_release(PDL)  # every weight byte of this program is read
    # the last program out resets the counters the launch waited on (every wait has returned)
    tl.debug_barrier()
    out = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if out == P - 1:
        offs = tl.arange(0, MAXC)
        for b in tl.static_range(1, NL):
            tl.store(chunks_ptr + b * MAXC + offs, tl.zeros([MAXC], tl.int32))
        tl.store(exit_ptr, 0)


@dataclass(frozen=True)
class ChainLayer:
    w: torch.Tensor  # e4m3 [N, K]
    scale: torch.Tensor  # e8m0 (or its bytes) [N / 128, K / 128]
    groups: int = 1
    quantize_act: bool = True
    out_dtype: torch.dtype = torch.bfloat16


def _layer_items(N: int, K: int, G: int, kps: int, splits: int, by_chunk: bool) -> list[tuple[int, int]]:
    """(tile, split) of a layer in launch order: tile-major, or (by_chunk) by the input chunk the item
    reads, then tile (so the first items need the chunks of the layer before that complete first)."""
    items = [(t, s) for t in range(-(-N // BLOCK_N)) for s in range(splits)]
    if by_chunk:
        group_n = N // G
        items.sort(key=lambda ts: ((ts[0] * BLOCK_N // group_n) * K + ts[1] * kps) // kps)
    return items


def plan(layers: list[ChainLayer]) -> list[dict]:
    """Each layer's N, K, split width (KPS), splits and rows per group, with linear_fp8's one-row
    configuration; a ValueError says what the kernel does not take."""
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"a chain has 1..{MAX_LAYERS} layers, got {len(layers)}")
    out = []
    for i, ly in enumerate(layers):
        N, K = ly.w.shape
        cfg = LIN.pick_config(1, N, K, ly.quantize_act)
        if (cfg.mode, cfg.block_n, cfg.block_m, cfg.block_k, cfg.num_warps) != ("f16", BLOCK_N, BLOCK_M, 128, 4):
            raise ValueError(f"layer {i}: linear_fp8 takes {cfg} for {N} x {K}; the chain runs only 'f16' with "
                             f"{BLOCK_N}-row tiles, 128-wide steps and 4 warps")
        kps = LIN._k_per_split(K, cfg)
        if K % kps or kps % BLOCK_N or N % ly.groups or (N // ly.groups) % 128:
            raise ValueError(f"layer {i}: K {K} in splits of {kps} and {N} rows in {ly.groups} groups must be "
                             "whole tiles and scale blocks")
        if i and ly.groups * K > out[-1]["N"]:
            raise ValueError(f"layer {i} reads {ly.groups} x {K} inputs, more than layer {i - 1} writes "
                             f"({out[-1]['N']})")
        if i < len(layers) - 1 and -(-N // kps) > MAX_CHUNKS:
            raise ValueError(f"layer {i}: {N} outputs make more than {MAX_CHUNKS} chunks")
        out.append(dict(N=N, K=K, kps=kps, splits=K // kps, G=N // ly.groups, tiles=-(-N // BLOCK_N)))
    return out


class LinearChain:
    """The launches of one chain (built once: its item table, partials and counters on the device).
    `__call__(x)` returns every layer's output. Launches of one LinearChain must not run concurrently
    (they share its partials and counters): one stream."""

    def __init__(self, layers: list[ChainLayer], programs: int | None = None):
        self.layers = layers
        self.params = plan(layers)
        dev = layers[0].w.device
        self.interpret = on_interpreter(layers[0].w)
        items, self.offs = [], []
        for i, p in enumerate(self.params):
            self.offs.append(len(items))
            items += _layer_items(p["N"], p["K"], layers[i].groups, p["kps"], p["splits"], by_chunk=i > 0)
        self.total = len(items)
        self.items = torch.tensor(items, dtype=torch.int32, device=dev).reshape(-1)
        self.programs = programs  # None: PROGRAMS_PER_SM per SM, read at each launch (1 under the interpreter)
        self.parts = [torch.empty(p["splits"] * p["tiles"] * BLOCK_N * BLOCK_M, device=dev) for p in self.params]
        self.tile_cnt = [torch.zeros(p["tiles"], dtype=torch.int32, device=dev) for p in self.params]
        self.chunks = torch.zeros((MAX_LAYERS + 1) * MAX_CHUNKS, dtype=torch.int32, device=dev)
        self.exit = torch.zeros(2, dtype=torch.int32, device=dev)  # programs out, error word
        self.compiled = None

    def check(self) -> None:
        """Raise if a wait of a launch so far gave up (its outputs are wrong). Syncs."""
        if self.exit[1].item():
            raise RuntimeError("a linear chain's wait gave up: not every program could run (too many programs "
                               "for the SMs left free?); its outputs are wrong")

    def __call__(self, x: torch.Tensor, ys: list[torch.Tensor] | None = None, mode: str = "chain",
                 gaps_ns: list[int] | None = None) -> list[torch.Tensor]:
        """x [M, G_0 K_0], M <= 16 -> [y_0, ..., y_{L-1}] (ys: given outputs [M, N_l], else new ones).
        mode "chain": one launch; "sep": one launch per layer (the stream orders them; no waits).
        gaps_ns: per layer, a wait after its first input chunk (probes: chain_probe.py --tchain)."""
        M = x.shape[0]
        if not 1 <= M <= BLOCK_M or x.shape[1] < self.layers[0].groups * self.params[0]["K"] or x.stride(1) != 1:
            raise ValueError(f"x {tuple(x.shape)} (stride {x.stride()}): 1..{BLOCK_M} rows of at least "
                             f"{self.layers[0].groups * self.params[0]['K']} contiguous values")
        if ys is None:
            ys = [torch.empty(M, p["N"], dtype=ly.out_dtype, device=x.device) for p, ly in zip(self.params, self.layers)]
        nl = len(self.layers)
        gaps_ns = gaps_ns or [0] * nl
        if mode not in ("chain", "sep"):
            raise ValueError(f"mode is 'chain' or 'sep', got {mode!r}")
        groups = [range(nl)] if mode == "chain" else [range(i, i + 1) for i in range(nl)]
        for g in groups:
            lo = self.offs[g[0]]
            hi = self.offs[g[-1] + 1] if g[-1] + 1 < nl else self.total
            offs = [self.offs[i] - lo for i in g[1:]] + [hi - lo] * (MAX_LAYERS - len(g))
            args, consts = [], {}
            for slot in range(MAX_LAYERS):
                i = g[min(slot, len(g) - 1)]  # an unused slot repeats the last layer (never read)
                p, ly = self.params[i], self.layers[i]
                args += [ly.w, ly.scale.view(torch.uint8), ys[i], self.parts[i], self.tile_cnt[i], p["N"], p["K"],
                         p["kps"], p["G"], gaps_ns[i]]
                consts[f"S{slot}"] = p["splits"]
                consts[f"Q{slot}"] = ly.quantize_act
            xin = x if g[0] == 0 else ys[g[0] - 1]
            P = self.programs or (1 if self.interpret else PROGRAMS_PER_SM * sm_count(x.device))
            P = P if mode == "chain" else min(P, hi - lo)
            opts = launch_opts(x, (P,), sum(self.layers[i].w.numel() for i in g))
            self.compiled = _chain_kernel[(P,)](
                self.items[2 * lo:], self.chunks, self.exit, xin, M, xin.stride(0), hi - lo, *offs[:3], *args,
                NL=len(g), BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, LINES=PREFETCH_LINES, MAXC=MAX_CHUNKS,
                INTERPRET=self.interpret, num_warps=4, num_stages=3, **consts, **opts)
        return ys


def max_programs(compiled, sms: int) -> int:
    """Programs of `compiled` (a launched _chain_kernel, 4 warps) that can be resident at once on `sms`
    sm_90 SMs (occupancy.per_sm's count)."""
    import occupancy

    return sms * occupancy.per_sm(4, compiled.n_regs, compiled.metadata.shared)[0]


def linear_chain_ref(x: torch.Tensor, layers: list[ChainLayer]) -> list[torch.Tensor]:
    """The same chain through `linear_fp8_ref` (layer l + 1 reads the first G K values of y_l)."""
    ys = []
    for ly in layers:
        xin = x if not ys else ys[-1][:, :ly.groups * ly.w.shape[1]]
        ys.append(LIN.linear_fp8_ref(xin.contiguous(), ly.w, ly.scale, out_dtype=ly.out_dtype,
                                     quantize_act=ly.quantize_act, groups=ly.groups))
    return ys
