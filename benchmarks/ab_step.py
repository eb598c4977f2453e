"""A/B arms of the decode step in one process: the decoder is built once, then every round times each
arm on fresh CUDA graphs, an arm being a few Python statements that change module settings.

    python benchmarks/ab_step.py --layers 30 --batch 1,2,4 --rounds 2 --json OUT.json \\
        --arm off= \\
        --arm 'qtail0=import megastep.model.fast as f; f.QNORM_TAIL_ROWS = 0'

Takes `megastep bench`'s arguments (one GPU; no --trace, --timeline, --peer-layers, --gpus) and prints,
per batch, each arm's p50 in every round and its median's change against the first arm's;
--timeline-batch B adds each arm's device timeline of one replay at B rows (the layers' anatomy, as
`megastep bench --timeline` prints it).

Why: a `megastep bench` process of a 30-layer step took 20-36 s after the call's first (weights,
decoder, compile cache, graph captures: the twenty-seventh measurement's calls) to time ~2 s of
steps, and a call's arms A/B/A/B as separate processes left few of them. Here an arm costs its
captures and its replays, a few seconds. Rounds are
interleaved (A B C, A B C) so that drift in clocks or temperature falls on every arm alike.

What an arm may change: settings of megastep's modules read when a step is captured or a kernel is
launched (a pin table, `fast.QNORM_TAIL_ROWS`, `fast.INDEXER_FIRST`, ...): every arm gets fresh
graphs. Not what FastDecoder reads or packs when it is built (its constructor's arguments: run
those as separate `megastep bench` processes). Every megastep module is imported before the
first arm; after each arm the globals its statements changed are put back, the contents of dicts,
lists and sets changed in place (a pin table's entry) included (what the measurement itself fills,
a workspace or a compiled kernel, stays for the next arm).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib
import json
import os
import pkgutil
import statistics
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import megastep  # noqa: E402
from megastep.errors import UserError  # noqa: E402


def read_result(path: str) -> dict:
    """A result this script (or `megastep bench --json`) wrote, gzipped as docs/data keeps them or
    not; OSError or json.JSONDecodeError when it cannot be read."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def read_result_or_say(path: str, prog: str) -> dict | None:
    """read_result for a script's main: None, with one line on stderr, when the file cannot be read."""
    try:
        return read_result(path)
    except (OSError, json.JSONDecodeError) as e:
        print(f"{prog}: cannot read {path}: {e}", file=sys.stderr)
        return None


def parse_arms(specs: list[str]) -> list[tuple[str, str]]:
    """--arm NAME=STATEMENTS (STATEMENTS may be empty: the defaults) -> [(name, statements)]."""
    arms = []
    for spec in specs:
        name, eq, code = spec.partition("=")
        name = name.strip()
        if not eq or not name or not all(c.isalnum() or c in "_-." for c in name):
            raise UserError(f"--arm must be NAME=STATEMENTS with a name of letters, digits, _ - or ., got {spec!r}")
        if any(name == n for n, _ in arms):
            raise UserError(f"--arm {name!r} is given twice")
        try:
            compile(code, f"<arm {name}>", "exec")
        except SyntaxError as e:
            raise UserError(f"--arm {name}: its statements do not parse: {e.msg} ({code!r})") from None
        arms.append((name, code))
    if not arms:
        raise UserError("give at least one --arm NAME=STATEMENTS (e.g. --arm off=)")
    return arms


def import_all() -> None:
    """Import every megastep module, so that the snapshot below covers any module an arm touches."""
    for info in pkgutil.walk_packages(megastep.__path__, "megastep."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional dependency this machine lacks (the server's)
            pass


def _contents(v):
    """A shallow copy of a mutable container's contents (None for anything else)."""
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, (list, set)):
        return list(v)
    return None


def _same_contents(v, saved) -> bool:
    """Whether container v still holds the very objects it held (by identity: values may be tensors)."""
    if isinstance(v, dict):
        return v.keys() == saved.keys() and all(v[k] is saved[k] for k in v)
    if len(v) != len(saved):
        return False
    if isinstance(v, list):
        return all(a is b for a, b in zip(v, saved))
    return all(any(a is b for b in saved) for a in v)


def snapshot() -> dict:
    """Every megastep module's globals: (value, a copy of a mutable container's contents)."""
    snap = {}
    for name, mod in list(sys.modules.items()):
        if name == "megastep" or name.startswith("megastep."):
            snap[name] = {k: (v, _contents(v)) for k, v in vars(mod).items() if not k.startswith("__")}
    return snap


def changes(snap: dict) -> list[tuple[str, str]]:
    """(module, name) of every global changed since `snapshot`: rebound, added, or a container's
    contents changed in place."""
    out = []
    for name, saved in snap.items():
        mod = sys.modules[name]
        out += [(name, k) for k in vars(mod) if not k.startswith("__") and k not in saved]
        for k, (v, contents) in saved.items():
            if getattr(mod, k, None) is not v or (contents is not None and not _same_contents(v, contents)):
                out.append((name, k))
    return out


def restore(snap: dict, keys: list[tuple[str, str]]) -> None:
    """Put back the globals `keys` as `snapshot` saw them (a name it did not see is removed)."""
    for name, k in keys:
        mod = sys.modules[name]
        if k not in snap[name]:
            delattr(mod, k)
            continue
        v, contents = snap[name][k]
        setattr(mod, k, v)
        if isinstance(v, dict):
            v.clear()
            v.update(contents)
        elif isinstance(v, list):
            v[:] = contents
        elif isinstance(v, set):
            v.clear()
            v.update(contents)


def with_arm(name: str, code: str, fn, changed_names: list[str]):
    """fn() with the arm's statements in effect, then what they changed put back (their names
    appended to changed_names, also when they or fn raise); fn's result."""
    snap, changed = snapshot(), []
    try:
        try:
            exec(compile(code, f"<arm {name}>", "exec"), {"__name__": f"arm_{name}"})
        finally:
            changed = changes(snap)
            changed_names += [f"{m}.{k}" for m, k in changed]
        return fn()
    finally:
        restore(snap, changed)


def run_arms(arms: list[tuple[str, str]], rounds: int, measure, log=print, progress=None) -> list[list[dict]]:
    """For each round, each arm: run its statements, `measure()` (a list of result rows), then put back
    what the statements changed (only that: caches the measurement fills stay). An arm that fails
    records its error and the rounds go on. progress(table so far) after each arm (a call killed at
    its time limit keeps what it had)."""
    import_all()
    table = []
    for r in range(rounds):
        row = []
        for name, code in arms:
            rec = {"arm": name, "round": r, "changed": []}
            try:
                rec["results"] = with_arm(name, code, measure, rec["changed"])
            except Exception as e:  # noqa: BLE001 (one arm's failure must not lose the others)
                traceback.print_exc()
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"round {r} arm {name}: " + (rec.get("error") or ", ".join(
                f"{x['batch']} rows {x['ms_p50']:.3f} ms" for x in rec["results"])))
            row.append(rec)
            if progress is not None:
                progress(table + [row])
        table.append(row)
    return table


def summarize(arms: list[tuple[str, str]], table: list[list[dict]]) -> str:
    """Per batch and arm: p50 of every round, and the change of their median against the first arm's."""
    batches = sorted({x["batch"] for row in table for rec in row for x in rec.get("results", [])})
    lines = [f"{'batch':>5} {'arm':<20} {'p50 ms per round':<32} {'median':>8} {'vs first':>8}"]
    for B in batches:
        base = None
        for name, _ in arms:
            p50 = [next(x["ms_p50"] for x in rec["results"] if x["batch"] == B)
                   for row in table for rec in row if rec["arm"] == name and "results" in rec]
            if not p50:
                lines.append(f"{B:>5} {name:<20} failed")
                continue
            med = statistics.median(p50)
            base = med if base is None else base
            lines.append(f"{B:>5} {name:<20} {' / '.join(f'{v:.3f}' for v in p50):<32} {med:>8.3f} "
                         f"{100 * (med / base - 1):>+7.2f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from megastep import bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_bench_arguments(ap)
    ap.add_argument("--arm", action="append", default=[], help="NAME=STATEMENTS (repeat; the first is the base)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeline-batch", type=int, default=0,
                    help="after the rounds, each arm's device timeline of one graph replay at this batch (one of "
                         "--batch): in the JSON, and each layer period's anatomy printed")
    args = ap.parse_args(argv)
    try:
        arms = parse_arms(args.arm)
        if args.rounds < 1:
            raise UserError("--rounds must be at least 1")
        for flag in ("trace", "timeline", "peer_layers", "gpus"):
            if getattr(args, flag):
                raise UserError(f"--{flag.replace('_', '-')} is megastep bench's alone: arms time graph replays on one "
                                "GPU (--timeline-batch B: each arm's timeline)")
        if args.timeline_batch and args.timeline_batch not in bench._batches(args.batch):
            raise UserError(f"--timeline-batch {args.timeline_batch} must be one of --batch {args.batch}")
        run = bench.setup(args)  # (checks --json's path too)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def on_fresh_graphs(fn):
        """fn(a StepRunner of new graphs); then the graphs and their memory pools go, before the
        next arm captures its own."""
        runner = run.runner(args)
        try:
            return fn(runner)
        finally:
            del runner
            gc.collect()
            torch.cuda.empty_cache()

    def measure():
        return on_fresh_graphs(lambda runner: bench.measure(run, runner, args, count_reads=False))  # times only

    out = {"device": torch.cuda.get_device_name(run.dec.device), "preset": args.preset,
           "layers": run.cfg.num_hidden_layers, "context": args.context, "iters": args.iters,
           "stream_read_GBps": run.bw, "arms": [{"name": n, "statements": c} for n, c in arms], "rounds": []}

    def write(table):
        out["rounds"] = table
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=str)

    table = run_arms(arms, args.rounds, measure, progress=write)
    if args.timeline_batch:
        from megastep.runtime.trace import timeline_summary

        out["timelines"] = {}
        for name, code in arms:
            def profile():
                acts = on_fresh_graphs(lambda runner: bench.timeline_graph(runner, args.timeline_batch, args.context,
                                                                           args.block))
                return {"summary": timeline_summary(acts), "activities": acts}

            try:
                out["timelines"][name] = with_arm(name, code, profile, [])
            except Exception as e:  # noqa: BLE001 (as in run_arms)
                traceback.print_exc()
                out["timelines"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            write(table)
    print(f"\n{run.cfg.num_hidden_layers} layers, context {args.context}, stream read {run.bw:.0f} GB/s, "
          f"{args.rounds} rounds of {len(arms)} arms")
    for name, tl in (out.get("timelines") or {}).items():
        if "error" in tl:
            print(f"\narm {name}: no timeline ({tl['error']})")
        else:
            bench.print_timeline(f"arm {name}, one graph replay of batch {args.timeline_batch}", tl)
    print(summarize(arms, table))  # last: h200_checks.sh's summary takes the table from the log's tail
    return 0


if __name__ == "__main__":
    sys.exit(main())
