"""The expert-parallel combine alone, on every GPU of the machine: per-layer pair buffers written,
then combined, 43 layers per CUDA graph, at M = 1, 6, 64 rows (top-6 of 256 experts, D 4096).

    python benchmarks/kernels/ep_combine.py [--layers 43] [--ms 1,6,64] [--json FILE]

Variants (the production ones and the knobs of the peer-to-peer kernel, to find its costs):
  allreduce      zeroed buffer, owned rows written, integer all-reduce through NCCL, slot-order sum
  p2p            kernels/pair_combine.py as used by the decoder
  p2p_cached     the same barrier, plain (L1-cached) loads of the peers' rows instead of ".cg"
  p2p_nowait     the gather and sum without the barrier (timing only: the result is not synchronized)
  local          the slot-order sum of a local buffer (the floor: no peer, no barrier)
Each rank times its own replays (median of --iters, after a barrier); rank 0 prints µs per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megastep.kernels import pair_combine as PC  # noqa: E402
from megastep.runtime import distributed as D  # noqa: E402


@triton.jit
def _variant_kernel(table_ptr, idx_ptr, out_ptr, flags_ptr, epoch_ptr, D, layer_off, flag_off, per, rank,
                    K: tl.constexpr, W: tl.constexpr, CG: tl.constexpr, WAIT: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    if WAIT:
        PC.arrive_and_wait(flags_ptr, epoch_ptr, flag_off, rank, W)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        row = (m * K + j).to(tl.int64) * D
        owner = tl.load(idx_ptr + m * K + j) // per
        base = tl.multiple_of(tl.load(table_ptr + owner).to(tl.pointer_type(tl.bfloat16)), 16) + layer_off
        if CG:
            v = tl.load(base + row + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            v = tl.load(base + row + offs, mask=mask, other=0.0).to(tl.float32)
        acc = v if j == 0 else acc + v
    tl.store(out_ptr + m.to(tl.int64) * D + offs, acc, mask=mask)


def _rank(r: D.Rank, layers: int, ms: list[int], iters: int):
    import torch.distributed as dist

    dev, W, K, E, Dm = r.device, r.world_size, 6, 256, 4096
    per = E // W
    peer = D.PeerPairs(layers, max(ms) * K, Dm, torch.bfloat16, dev)
    g = torch.Generator().manual_seed(0)
    res = {}
    for M in ms:
        idx = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(M)]).to(dev)
        mine = ((idx // per) == r.rank).reshape(-1)
        src = torch.randn(M * K, Dm, generator=g).to(torch.bfloat16).to(dev)
        zero_pad = torch.zeros(M * K, Dm, dtype=torch.bfloat16, device=dev)

        def write(L):  # the experts kernel's stand-in: this rank's rows into its layer buffer
            buf = peer.buffer(L, M * K)
            torch.where(mine[:, None], src, zero_pad, out=buf)
            return buf

        bufs_pad = [torch.zeros(M, K, Dm, dtype=torch.bfloat16, device=dev) for _ in range(layers)]

        def allreduce(L):
            torch.where(mine[:, None], src, zero_pad, out=bufs_pad[L].view(M * K, Dm))
            D.ordered_combine(bufs_pad[L])
            return PC.sum_pairs(bufs_pad[L])

        def knob(cg, wait):
            def run(L):
                out = torch.empty(M, Dm, dtype=torch.float32, device=dev)
                _variant_kernel[(M, 4)](peer.table, idx, out, peer.flag_table, peer.epoch, Dm, L * peer.max_pairs * Dm,
                                        L * W, per, r.rank, K=K, W=W, CG=cg, WAIT=wait, BLOCK_D=1024,
                                        num_warps=4)
                return out
            return run

        variants = {
            "allreduce": allreduce,
            "p2p": lambda L: peer.combine(L, idx, per),
            "p2p_cached": knob(False, True),
            "p2p_nowait": knob(True, False),
            "local": lambda L: PC.sum_pairs(peer.buffer(L, M * K).view(M, K, Dm)),
        }
        bufs_pad = [torch.zeros(M, K, Dm, dtype=torch.bfloat16, device=dev) for _ in range(layers)]


        want = PC.sum_pairs(src.view(M, K, Dm))
        for name, fn in variants.items():
            def body():
                peer.begin_step()
                outs = []
                for L in range(layers):
                    if name != "allreduce":
                        write(L)
                    outs.append(fn(L))
                return outs
            for _ in range(2):
                outs = body()
            torch.cuda.synchronize()
            ok = all(torch.equal(o, want) for o in outs) if name not in ("p2p_nowait", "local") else None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            times = []
            for _ in range(iters):
                torch.cuda.synchronize()
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / layers)
            res[f"{name} M={M}"] = {"us_per_layer": statistics.median(times), "ok": ok}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--ms", default="1,6,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    n = torch.cuda.device_count()
    outs = D.launch(_rank, n, (a.layers, [int(m) for m in a.ms.split(",")], a.iters), backend="nccl",
                    gpus=list(range(n)), timeout_s=900)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(outs, f, indent=1)
    print(f"{'variant':<22}" + "".join(f"{'rank ' + str(r) + ' us/layer':>18}" for r in range(n)) + "  bits")
    for key in outs[0]:
        print(f"{key:<22}" + "".join(f"{o[key]['us_per_layer']:>18.2f}" for o in outs) + f"  {outs[0][key]['ok']}")


if __name__ == "__main__":
    main()
