"""Where the CUDA routing launch's time goes (kernels/route_cuda.cu), at V4-Flash's router shape
(256 experts, top-6, D 4096), by timing builds of it with early exits and variants.

    python benchmarks/kernels/route_probe.py [--rows 1,4,16] [--out DIR] [--json FILE]

Why: in the step the launch takes ~7 us after the 5 us gate GEMV at 1 row (docs/PERFORMANCE.md,
twelfth measurement), where Triton's `route` launch alone takes 4.2; the same early-exit method
found the 7 us routing tail of the one-launch router (branch exp/router-cuda).

Each probe is the kernel built from a copy of route_cuda.cu with one text edit (PROBES; the
edits are checked to hit exactly once), launched through route_cuda.route_group(kernel=...):
- exit_after_wait: the launch floor (PDL wait, release, exit);
- exit_after_scores: + the logits and bias loads and the 8 scores of each lane;
- exit_after_topk: + the k argmax rounds and the ascending read-out;
- (the production build, no grouping): + the weights and the stores;
- epl_8: the production kernel with E / 32 fixed at 8 (V4-Flash), so the per-expert branches
  fold away; its results must equal the production build's bit for bit (checked).
and for scale router.py's `route` (one program per row) and `route_group` alone, and
route_cuda with grouping and x's quantization. us per call: a CUDA graph of 32 calls, median of
20 replays (bench_kernels.graph_time), PDL on as in the step. A short table last.
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

# (name, [(text in route_cuda.cu, replacement)]): exits keep what they skip past alive through a
# store that never happens (a value no input gives), so the compiler cannot drop the work
PROBES = [
    ("exit_after_wait", [("  pdl_release();\n", "  pdl_release();\n  return;\n")]),
    ("exit_after_scores", [("    int my = 0;  // lane t < k", "    if (s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7] == -1.f) wts[0] = 0.f;\n"
                            "    return;\n    int my = 0;  // lane t < k")]),
    ("exit_after_topk", [("    // the weights: the chosen scores", "    if (my == -1) wts[0] = 0.f;\n    return;\n"
                          "    // the weights: the chosen scores")]),
    ("epl_8", [("const int epl = E / 32, b =", "constexpr int epl = 8;\n  const int b =")]),
]


_HEADER = os.path.join(os.path.dirname(route_cuda.SOURCE), "cuda_common.cuh")  # route_cuda.cu includes it


def probe_kernels(out_dir: str) -> dict:
    """name -> the route_group kernel built from an edited copy of route_cuda.cu (its header
    copied beside it)."""
    src = open(route_cuda.SOURCE).read()
    header = open(_HEADER).read()
    kernels = {}
    for name, edits in PROBES:
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
        kernels[name] = CudaModule(path).kernel("route_group", route_cuda._KERNEL.signature)
    return kernels


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
        want = route_cuda.route_group(logits[0], bias, None, None, K, SCALING)
        got = route_cuda.route_group(logits[0], bias, None, None, K, SCALING, kernel=kernels["epl_8"])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "epl_8 changed the results"
        cases = {name: (lambda lg, kern=kern: route_cuda.route_group(lg, bias, None, None, K, SCALING, kernel=kern))
                 for name, kern in kernels.items()}
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
