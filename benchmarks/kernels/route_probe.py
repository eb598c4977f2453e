"""Where the CUDA routing launch's time goes (kernels/route_cuda.cu), at V4-Flash's router shape
(256 experts, top-6, D 4096), by timing builds of it with early exits and variants.

    python benchmarks/kernels/route_probe.py [--rows 1,4,16] [--out DIR] [--json FILE]

Why: in the step the launch took ~7 us after the 5 us gate GEMV at 1 row (docs/PERFORMANCE.md,
twelfth measurement), where Triton's `route` launch alone takes 4.2; the same early-exit method
found the 7 us routing tail of the one-launch router (branch exp/router-cuda). Its probes then
showed the top-k rounds taking 4.7 us and a build with E / 32 fixed at 8 taking 4.1 us in all, so
the production build fixes it (route_cuda.build_flags); and then the shuffle argmax and the
__fns read-out taking 0.8 us together, so production has a redux.sync argmax and a read-out
through shared memory (3.3 us; thirteenth measurement).

Each probe is the kernel built from a copy of route_cuda.cu with text edits (PROBES; each edit
is checked to hit exactly once), launched through route_cuda.route_group(kernel=...):
- exit_after_wait: the launch floor (PDL wait, release, exit);
- exit_after_scores: + the logits and bias loads and the 8 scores of each lane;
- exit_after_topk: + the k argmax rounds and the ascending read-out;
- (the production build, no grouping): + the weights and the stores;
- shuffle_argmax, fns_readout, shuffle_fns: production with the earlier argmax (a 5-step shuffle
  reduction), the earlier read-out (__fns), or both; these must give production's results bit for
  bit (checked before timing, ties and -0 included).
The exits' results stop early, so only their time is looked at. For scale router.py's `route`
(one program per row) and `route_group` alone, and route_cuda with grouping and x's
quantization. us per call: a CUDA graph of 32 calls, median of 20 replays
(bench_kernels.graph_time), PDL on as in the step. A short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_kernels import graph_time, write_results  # noqa: E402

from megastep.kernels import common, route_cuda, router  # noqa: E402
from megastep.kernels.cuda_module import CudaModule  # noqa: E402

E, D, K, SCALING = 256, 4096, 6, 2.5

# (name, [(text in route_cuda.cu, replacement)], exact): exits keep what they skip past alive
# through a store that never happens (a value no input gives), so the compiler cannot drop the work;
# an exact variant must give the production build's results bit for bit (checked before timing)
_REDUX_ARGMAX = """      {  // the warp's best in two redux.sync: the largest key (its bits made unsigned-ordered, -0 as
         // +0 as float compares see it), then the lowest id among the lanes holding it
        uint32_t u = __float_as_uint(bv);
        u = u == 0x80000000u ? 0u : u;
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
        const uint32_t top = __reduce_max_sync(0xffffffffu, u);
        be = __reduce_min_sync(0xffffffffu, u == top ? be : 0x7FFFFFFF);
      }
"""
_SHUFFLE_ARGMAX = """#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (beats(ov, oe, bv, be)) {
          bv = ov;
          be = oe;
        }
      }
"""
_SMEM_READOUT = """    int base = 0;  // the chosen set in ascending order: each chosen expert writes itself at its position
#pragma unroll
    for (int i = 0; i < kEPL; ++i) {
      const unsigned m = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
      if ((chosen >> i) & 1u) order[base + __popc(m & ((1u << lane) - 1u))] = i * 32 + lane;
      base += __popc(m);
    }
    __syncwarp();
    if (lane < k) my = order[lane];
"""
_FNS_READOUT = """    int base = 0;  // the chosen set read out in ascending order
#pragma unroll
    for (int i = 0; i < kEPL; ++i) {
      const unsigned m = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
      const int c = __popc(m);
      if (lane >= base && lane < base + c) my = i * 32 + static_cast<int>(__fns(m, 0, lane - base + 1));
      base += c;
    }
"""
_WAIT = "  pdl_wait();  // the logits and x are the previous kernels' outputs\n  pdl_release();\n"
# route_row (route_cuda.cu's device function, which route_group calls) returns a row's expert: the exits
# return early from it, route_group then stops (no grouping in the probes)
PROBES = [
    ("exit_after_wait", [(_WAIT, _WAIT + "  return;\n")], False),
    ("exit_after_scores", [("  int my = 0;  // lane t < k", "  if (s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7] == -1.f) "
                            "wts[0] = 0.f;\n  return 0;\n  int my = 0;  // lane t < k")], False),
    ("exit_after_topk", [("  // the weights: the chosen scores", "  if (my == -1) wts[0] = 0.f;\n  return my;\n"
                          "  // the weights: the chosen scores")], False),
    # the top-k of the thirteenth measurement's first build, piece by piece
    ("shuffle_argmax", [(_REDUX_ARGMAX, _SHUFFLE_ARGMAX)], True),
    ("fns_readout", [(_SMEM_READOUT, _FNS_READOUT)], True),
    ("shuffle_fns", [(_REDUX_ARGMAX, _SHUFFLE_ARGMAX), (_SMEM_READOUT, _FNS_READOUT)], True),
]


_HEADER = os.path.join(os.path.dirname(route_cuda.SOURCE), "cuda_common.cuh")  # route_cuda.cu includes it


def probe_kernels(out_dir: str) -> dict:
    """name -> (the route_group kernel built from an edited copy of route_cuda.cu (its header
    copied beside it), exact)."""
    src = open(route_cuda.SOURCE).read()
    header = open(_HEADER).read()
    kernels = {}
    for name, edits, exact in PROBES:
        text = src
        for old, new in edits:
            assert text.count(old) == 1, (name, old)
            text = text.replace(old, new)
        path = os.path.join(out_dir, name, os.path.basename(route_cuda.SOURCE))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        with open(os.path.join(os.path.dirname(path), os.path.basename(_HEADER)), "w") as f:
            f.write(header)
        module = CudaModule(path, extra_flags=route_cuda.build_flags(E))
        kernels[name] = (module.kernel("route_group", route_cuda.SIGNATURES["route_group"]), exact)
    return kernels


def check_exact(name: str, kern, B: int, bias: torch.Tensor, g: torch.Generator) -> None:
    """The variant's experts and weights equal the production build's, bit for bit: random logits
    with and without the bias, and logits of few distinct values (ties, -0 among them)."""
    ties = torch.randint(-2, 3, (B, E), generator=g).float()
    ties[ties == 0] = -0.0
    for lg, b in (((torch.randn(B, E, generator=g) * 4), bias), (ties, None), (ties, bias)):
        lg = lg.cuda()
        want = route_cuda.route_group(lg, b, None, None, K, SCALING)
        got = route_cuda.route_group(lg, b, None, None, K, SCALING, kernel=kern)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), \
            f"{name} changed the results at {B} rows"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp())
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels = probe_kernels(args.out)
    g = torch.Generator().manual_seed(0)
    bias = (torch.randn(E, generator=g) * 0.5).cuda()
    common.set_pdl(True)
    rows = []
    for B in (int(r) for r in args.rows.split(",")):
        logits = [(torch.randn(B, E, generator=g) * 4).cuda() for _ in range(32)]
        x = (torch.randn(B, D, generator=g) * 2).bfloat16().cuda()
        for name, (kern, exact) in kernels.items():
            if exact:
                check_exact(name, kern, B, bias, g)
        cases = {name: (lambda lg, kern=kern: route_cuda.route_group(lg, bias, None, None, K, SCALING, kernel=kern))
                 for name, (kern, _) in kernels.items()}
        cases["route_cuda"] = lambda lg: route_cuda.route_group(lg, bias, None, None, K, SCALING)
        if B * K <= route_cuda.MAX_GROUPED_PAIRS:
            cases["route_cuda_grouped"] = lambda lg: route_cuda.route_group(lg, bias, None, None, K, SCALING, x,
                                                                            permute=False)
        cases["triton_route"] = lambda lg: router.route(lg, bias, None, K, SCALING)
        if B * K <= router.MAX_GROUPED_PAIRS:
            cases["triton_route_group"] = lambda lg: router.route_group(lg, bias, None, K, SCALING, x, permute=False)
        for name, fn in cases.items():
            us, best = graph_time([lambda lg=lg, fn=fn: fn(lg) for lg in logits])
            rows.append({"rows": B, "case": name, "us": round(us, 2), "min_us": round(best, 2)})
            print(json.dumps(rows[-1]), flush=True)
    common.set_pdl(False)
    write_results(args.json, rows)
    print(f"{'rows':>4}  {'case':<22} {'us':>7}")
    for r in rows:
        print(f"{r['rows']:>4}  {r['case']:<22} {r['us']:>7.2f}")


if __name__ == "__main__":
    main()
