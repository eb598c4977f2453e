"""Plot a `megastep bench --json` result: ms/step against batch, next to the roofline; other
results of the same model (e.g. another experts mode) overlaid.

python benchmarks/plot_bench.py RESULT.json OUT.png [OTHER.json[=LABEL] ...]

An overlaid result is labelled by what sets it apart in its JSON (experts mode, MoE launch
options), or by LABEL where the difference is not recorded there (e.g. a kernel experiment).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _differs(d: dict, o: dict) -> str:
    """What sets result o apart from d: the experts mode, else the MoE launch order's options."""
    if o.get("moe_mode") != d.get("moe_mode"):
        return f"experts {o['moe_mode']}"
    keys = ("router", "shared_after_router", "shared_w2", "pdl")
    return ", ".join(f"{k} {o.get(k)}" for k in keys if o.get(k) != d.get(k)) or "another run"


def main(src: str, dst: str, others: list[str]) -> None:
    d = json.load(open(src))
    rs = d["results"]
    b = [r["batch"] for r in rs]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(b, [r["ms_p50"] for r in rs], "o-", label=f"megastep fast path (CUDA graph, p50), experts {d['moe_mode']}")
    for other in others:
        path, _, label = other.partition("=")
        o = json.load(open(path))
        ax.plot([r["batch"] for r in o["results"]], [r["ms_p50"] for r in o["results"]], "^:",
                label=f"the same, {label or _differs(d, o)}")
    gpus = d.get("gpus", 1)
    per = " per GPU" if gpus > 1 else ""
    ax.plot(b, [r["roofline_ms"] for r in rs], "s--", label=f"roofline: bytes{per} / {d['stream_read_GBps']:.0f} GB/s")
    if d.get("peer") and d["peer"].get("ms_per_layer"):
        ax.plot([1], [d["peer"]["ms_per_layer"] * d["layers"]], "x", ms=10,
                label=f"transformers ({d['peer']['best_impl']}), scaled to {d['layers']} layers")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per step (batch)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{d['preset']} {d['layers']} layers, context {d['context']}, {d['device']}"
                 f"{f' x{gpus}' if gpus > 1 else ''} ({d['date']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
