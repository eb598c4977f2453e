"""A probe, not used by the runtime: a chain of FP8 linears at one row in ONE persistent Triton launch,
with the Triton loop of `linear_fp8` (its "f16" mode, its tiles and K splits, so its bits).

Why. At one row each 33.6 MB FP8 stream of the step costs ~5.8 us + bytes / 4.0 TB/s on the H200
(docs/PERFORMANCE.md, 2026-12-06 from 13:33 UTC): the body streams near the read, and ~6 us goes at
every launch boundary. chain_probe.cu asked whether one persistent launch removes the boundary, but
with hand-written CUDA loops that streamed below Triton's rate even a launch a layer (2026-12-05), so
it could not separate the two. This probe keeps Triton's loop and changes only the launch structure:
if the chain in one launch is not faster than the same items launched a layer at a time, the
boundary is not what a persistent kernel can take back; if it is, by how much per boundary.

What runs. x [1, G0 K0] fp32 in, y_l [N_l] fp32 out; layer l + 1 reads the first G K values of y_l
(chain_probe.Chain's layers). A layer's items are (row tile of BLOCK_N = 64 outputs, K split) with
`linear_fp8.pick_config(1, N, K)`'s split and a 16-row tile (row 0 real, the rest masked, as the
step's linears at one row). P programs walk one global list of every layer's items round robin
(program p: items p, p + P, ...). An item's loop is `_linear_fp8_kernel`'s "f16" loop (the same
loads, quantization, `_code_dot` and scale order), its split partials summed in split order by the
tile's last arriving item (an arrival counter per tile), so every y has linear_fp8's bits (checked).
Dependencies: an item of layer l + 1 reads one chunk of y_l (its split's KPS columns of its group);
the item that completes a tile of y_l adds one to that chunk's counter (release), and a consumer
spins on the counter (acquire) until all KPS / 64 tiles of its chunk are in. Before it spins, it asks
L2 for the first LINES 128-byte lines of each of its 64 weight rows (its weights never depend on the
wait). Layer l + 1's items are ordered by the chunk they read, so the first ones need the chunks that
complete first. The last program out resets the chunk counters (the tile counters are reset by their
last arrivers), so graph replays start from zero. gaps: after its first wait of a layer, a program
spins that layer's gap (chain_probe.CHAINS: the latency-bound stage before the layer in the step)
on the global timer, standing for that stage run inside the persistent launch while the other
programs' weight prefetches are in flight.

Every program must be resident at once (a consumer spins for producers that may not have started
otherwise): `TritonChain` refuses more programs than the compiled kernel's occupancy allows.
Under the interpreter (CPU tests) programs run one after another, so only P = 1 works there (no
waits are ever needed: one program makes every item in order).
"""

from __future__ import annotations

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
    on_interpreter,
)
from megastep.kernels.spin import wait_ns

BLOCK_N = 64  # linear_fp8's row tile at one row (checked against pick_config)
BLOCK_M = 16  # linear_fp8's row tile for M <= 16
MAX_LAYERS = 4
MAX_CHUNKS = 64  # chunk counters per layer
GIVE_UP = tl.constexpr(1 << 22)  # polls of a chunk counter before a wait gives up (~0.5 s or more)


@triton.jit
def _item(x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, in_ptr, out_ptr, tile, s, N, K, KPS, GROUP_N, NEXT_KPS,
          gap_ns, exit_ptr, SPLIT_K: tl.constexpr, QUANT: tl.constexpr, WAIT: tl.constexpr, SIGNAL: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, LINES: tl.constexpr, INTERPRET: tl.constexpr):
    """One (row tile, K split) of a layer: `_linear_fp8_kernel`'s "f16" loop and split-K sum at M = 1."""
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < 1
    k_lo = s * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    x_off = (n0 // GROUP_N) * K  # grouped (wo_a): output rows of group g read input columns [g K, (g + 1) K)
    if WAIT:
        if LINES > 0:
            if not INTERPRET:
                l2_prefetch_rows(w_ptr, n0, N, K, s, KPS, K, BLOCK_N, LINES)
        chunk = (x_off + k_lo) // KPS
        need = KPS // BLOCK_N
        got = tl.atomic_add(in_ptr + chunk, 0, sem="acquire", scope="gpu")
        tries = 0
        while (got < need) & (tries < GIVE_UP):
            got = tl.atomic_add(in_ptr + chunk, 0, sem="acquire", scope="gpu")
            tries += 1
        if got < need:  # not every program resident: say so rather than hang (the output is wrong)
            tl.atomic_xchg(exit_ptr + 1, 1)
        if gap_ns > 0:
            if not INTERPRET:
                wait_ns(gap_ns)
        tl.debug_barrier()
    ws_row = ws_ptr + (n0 // 128) * tl.cdiv(K, 128)
    w_rows = w_ptr + offs_n[:, None] * K
    x_rows = x_ptr + x_off + offs_m[:, None] * 0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        # .cg: x was written by other SMs during this launch (L1 is not coherent)
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        if QUANT:
            sx, inv = fp8_pow2_scale(tl.max(tl.abs(xt), axis=1))
            q = fp8_round(xt, inv[:, None], INTERPRET)
        else:  # wo_a: the activation itself, scaled into fp16's range
            sx, inv = f16_pow2_scale(tl.max(tl.abs(xt), axis=1))
            q = (xt * inv[:, None]).to(tl.float16)
        acc += LIN._code_dot(w, q, INTERPRET) * (sx * e8m0_to_f32(tl.load(ws_row + k0 // 128)))[None, :]

    out_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    done = True
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
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
            tl.store(out_ptrs, tot, mask=out_mask)
            tl.store(cnt_ptr + tile, 0)
    if SIGNAL:
        if done:
            tl.debug_barrier()  # every thread's stores of the tile are issued before the release
            tl.atomic_add(out_ptr + n0 // NEXT_KPS, 1, sem="release", scope="gpu")


@triton.jit
def _chain_kernel(
    items_ptr, chunks_ptr, exit_ptr, x0_ptr, total, off1, off2, off3,
    w0, s0, y0, p0, c0, n0, k0, kps0, g0, gap0,
    w1, s1, y1, p1, c1, n1, k1, kps1, g1, gap1,
    w2, s2, y2, p2, c2, n2, k2, kps2, g2, gap2,
    w3, s3, y3, p3, c3, n3, k3, kps3, g3, gap3,
    NL: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, Q3: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LINES: tl.constexpr, MAXC: tl.constexpr, INTERPRET: tl.constexpr,
):
    # layer l > 0 waits on counter block l (its chunks of y_{l-1}); layer l < NL - 1 signals block l + 1;
    # exit_ptr: [the programs out, an error word (a wait gave up)]
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    layer_seen = -1  # the last layer this program waited in (its gap is spun once per layer)
    for j in range(pid, total, P):
        tile = tl.load(items_ptr + 2 * j)
        s = tl.load(items_ptr + 2 * j + 1)
        if j < off1:
            _item(x0_ptr, w0, s0, y0, p0, c0, chunks_ptr, chunks_ptr + MAXC, tile, s, n0, k0, kps0, g0, kps1,
                  tl.where(layer_seen < 0, gap0, 0), exit_ptr, S0, Q0, False, NL > 1, BLOCK_N, BLOCK_M, LINES,
                  INTERPRET)
            layer_seen = 0
        elif NL > 1:
            if j < off2:
                _item(y0, w1, s1, y1, p1, c1, chunks_ptr + MAXC, chunks_ptr + 2 * MAXC, tile, s, n1, k1, kps1, g1,
                      kps2, tl.where(layer_seen < 1, gap1, 0), exit_ptr, S1, Q1, True, NL > 2, BLOCK_N, BLOCK_M,
                      LINES, INTERPRET)
                layer_seen = 1
            elif NL > 2:
                if j < off3:
                    _item(y1, w2, s2, y2, p2, c2, chunks_ptr + 2 * MAXC, chunks_ptr + 3 * MAXC, tile, s, n2, k2,
                          kps2, g2, kps3, tl.where(layer_seen < 2, gap2, 0), exit_ptr, S2, Q2, True, NL > 3,
                          BLOCK_N, BLOCK_M, LINES, INTERPRET)
                    layer_seen = 2
                elif NL > 3:
                    _item(y2, w3, s3, y3, p3, c3, chunks_ptr + 3 * MAXC, chunks_ptr + 4 * MAXC, tile, s, n3, k3,
                          kps3, g3, kps3, tl.where(layer_seen < 3, gap3, 0), exit_ptr, S3, Q3, True, False, BLOCK_N,
                          BLOCK_M, LINES, INTERPRET)
                    layer_seen = 3
    # the last program out resets the counters it read (every wait of this launch has returned)
    tl.debug_barrier()
    out = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if out == P - 1:
        offs = tl.arange(0, MAXC)
        for b in tl.static_range(1, NL):
            tl.store(chunks_ptr + b * MAXC + offs, tl.zeros([MAXC], tl.int32))
        tl.store(exit_ptr, 0)


def _layer_items(N: int, K: int, G: int, kps: int, splits: int, by_chunk: bool) -> list[tuple[int, int]]:
    """(tile, split) of a layer in launch order: tile-major, or (by_chunk) by the input chunk the item
    reads, then tile (so the first items need the chunks of the layer before that complete first)."""
    items = [(t, s) for t in range(-(-N // BLOCK_N)) for s in range(splits)]
    if by_chunk:
        group_n = N // G
        items.sort(key=lambda ts: ((ts[0] * BLOCK_N // group_n) * K + ts[1] * kps) // kps)
    return items


class TritonChain:
    """A chain's launches through `_chain_kernel`: `launch("chain")` is one launch for every layer,
    `launch("sep")` one launch per layer of the same kernel (no waits: the stream orders them).
    chain: benchmarks/kernels/chain_probe.Chain (its weights, x0, ys); programs: P of the chain launch
    (every sep launch takes as many programs as its layer has items, at most P... see `launch`)."""

    def __init__(self, chain, programs: int, lines: int = 8, quant: tuple[bool, ...] | None = None):
        self.chain = chain
        self.P = programs
        self.lines = lines
        dev = chain.x0.device
        self.interpret = on_interpreter(chain.x0)
        nl = len(chain.layers)
        if not 1 <= nl <= MAX_LAYERS:
            raise ValueError(f"a chain has 1..{MAX_LAYERS} layers, got {nl}")
        # every layer's activation quantized, as chain_probe's checks and its Triton row take them (the
        # step's wo_a takes its own unquantized: quant=(..., False, ...); the same loads either way)
        self.quant = quant or (True,) * len(chain.layers)
        self.params = []
        items = []
        self.offs = []
        for i, ly in enumerate(chain.layers):
            N, K = ly.w.shape
            cfg = LIN.pick_config(1, N, K)
            if (cfg.mode, cfg.block_n, cfg.block_m, cfg.block_k, cfg.num_warps) != ("f16", BLOCK_N, BLOCK_M, 128, 4):
                raise ValueError(f"layer {i}: linear_fp8 takes {cfg} at one row; this probe reproduces only "
                                 f"'f16' with {BLOCK_N}-row tiles, 128-wide steps and 4 warps")
            kps = LIN._k_per_split(K, cfg)
            splits = -(-K // kps)
            if K % kps or kps % BLOCK_N or (i and N // ly.G % BLOCK_N):
                raise ValueError(f"layer {i}: K {K} in splits of {kps} (and a group's rows) must be whole tiles")
            if i and ly.G * K > chain.layers[i - 1].w.shape[0]:
                raise ValueError(f"layer {i} reads {ly.G} x {K} inputs, more than layer {i - 1} writes")
            if -(-N // kps) > MAX_CHUNKS and i < nl - 1:
                raise ValueError(f"layer {i}: {N} outputs make more than {MAX_CHUNKS} chunks")
            self.offs.append(len(items))
            items += _layer_items(N, K, ly.G, kps, splits, by_chunk=i > 0)
            self.params.append(dict(N=N, K=K, kps=kps, splits=splits, G=N // ly.G, tiles=-(-N // BLOCK_N)))
        self.total = len(items)
        self.items = torch.tensor(items, dtype=torch.int32, device=dev).reshape(-1)
        self.parts = [torch.empty(p["splits"] * p["tiles"] * BLOCK_N * BLOCK_M, device=dev) for p in self.params]
        self.tile_cnt = [torch.zeros(p["tiles"], dtype=torch.int32, device=dev) for p in self.params]
        self.chunks = torch.zeros((MAX_LAYERS + 1) * MAX_CHUNKS, dtype=torch.int32, device=dev)
        self.exit = torch.zeros(2, dtype=torch.int32, device=dev)  # programs out, error word
        self.compiled = None

    def _args(self, layers: range, gaps: list[float]):
        """The kernel's per-layer arguments for chain layers `layers` (padded to MAX_LAYERS)."""
        c = self.chain
        out, consts = [], {}
        for slot in range(MAX_LAYERS):
            if slot < len(layers):
                i = layers[slot]
                p, ly = self.params[i], c.layers[i]
                out += [ly.w, ly.ws.view(torch.uint8), c.ys[i], self.parts[i], self.tile_cnt[i], p["N"], p["K"], p["kps"], p["G"],
                        round(gaps[i] * 1000)]
                consts[f"S{slot}"] = p["splits"]
                consts[f"Q{slot}"] = self.quant[i]
            else:  # unused slot: the last layer's values (never read)
                out += out[-10:]
                consts[f"S{slot}"] = 1
                consts[f"Q{slot}"] = True
        return out, consts

    def launch(self, mode: str = "chain", gaps: list[float] | None = None) -> None:
        """mode "chain": one launch of P programs for every layer; "sep": one launch per layer, as many
        programs as its items (at most P), the stream ordering them (no waits)."""
        nl = len(self.chain.layers)
        gaps = gaps or [0.0] * nl
        if mode == "chain":
            groups = [range(nl)]
        elif mode == "sep":
            groups = [range(i, i + 1) for i in range(nl)]
        else:
            raise ValueError(f"mode is 'chain' or 'sep', got {mode!r}")
        for g in groups:
            lo = self.offs[g[0]]
            hi = self.offs[g[-1] + 1] if g[-1] + 1 < nl else self.total
            offs = [self.offs[i] - lo for i in g[1:]] + [hi - lo] * (MAX_LAYERS - len(g))
            layer_args, consts = self._args(g, gaps)
            x0 = self.chain.x0 if g[0] == 0 else self.chain.ys[g[0] - 1]
            P = self.P if mode == "chain" else min(self.P, hi - lo)
            k = _chain_kernel[(P,)](
                self.items[2 * lo:], self.chunks, self.exit, x0, hi - lo, *offs[:3], *layer_args,
                NL=len(g), BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, LINES=self.lines,
                MAXC=MAX_CHUNKS, INTERPRET=self.interpret, num_warps=4, num_stages=3, **consts)
            if mode == "chain":
                self.compiled = k


def max_programs(compiled, sms: int) -> int:
    """Programs of `compiled` (a launched _chain_kernel) that can be resident at once on `sms` SMs of
    a Hopper GPU (64K registers, 227 KB of shared memory and 32 CTAs an SM; registers are allocated per
    warp in units of 256)."""
    regs = max(compiled.n_regs, 1)
    warp_regs = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (warp_regs * 4)
    shared = compiled.metadata.shared
    by_smem = (227 * 1024) // (shared + 1024) if shared else 32
    return sms * min(by_regs, by_smem, 32)
