"""Plot full-model runs with cold experts in host memory (`megastep bench --hbm-budget ... --json`):
ms/token per routing model and batch, next to the modeled limit (HBM bytes / HBM bandwidth +
host bytes / host-read bandwidth, both measured in the run).

python benchmarks/plot_offload.py OUT.png RESULT.json [RESULT.json ...]
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(dst: str, srcs: list[str]) -> None:
    runs = [json.load(open(s)) for s in srcs]
    labels, got, limit = [], [], []
    for d in runs:
        for r in d["results"]:
            labels.append(f"{d['routing']}\nbatch {r['batch']}")
            got.append(r["ms_p50"])
            limit.append(r["roofline_ms"])
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], got, 0.4, label="megastep, recipe A (GPU zero-copy), p50")
    ax.bar([i + 0.2 for i in x], limit, 0.4, label="modeled limit (HBM + host link, measured bandwidths)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per step")
    d = runs[0]
    ax.set_title(f"{d['preset']} {d['layers']} layers, HBM budget {d['placement']['hbm_budget_GB']} GB, "
                 f"{d['device']} ({d['date']})", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
