"""OpenAI-compatible HTTP server: `megastep serve` (see `add_serve_arguments` / `serve_main`).

The CLI wires `megastep serve` to these two functions; `python -m megastep.server` runs the same.
FastAPI and uvicorn are imported only when the server starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from megastep.errors import budget_arg


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                             "default: the built-in tiny model")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients must send (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-seqs", type=int, default=8, help="sequences decoded at once (state-pool slots)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="state-pool size in tokens, shared by all sequences (default: sized by the engine)")
    parser.add_argument("--chunk", type=int, default=256, help="most prompt tokens prefilled per step")
    parser.add_argument("--queue-limit", type=int, default=256,
                        help="most requests waiting for admission; more get HTTP 429")
    parser.add_argument("--default-max-tokens", type=int, default=1024,
                        help="max_tokens of a chat request that gives none (capped by the room left)")
    parser.add_argument("--device", default=None,
                        help="where the reference engine runs: cpu (default) or cuda[:N]; on a GPU the "
                             "state pool is sized from free memory after weights unless --capacity is given")
    parser.add_argument("--gpus", default=None,
                        help="e.g. 0,1,2,3: the fast engine on several GPUs, one process each, the routed experts "
                             "split across them (expert parallelism over NCCL); this process serves HTTP")
    parser.add_argument("--engine", default="auto", choices=["auto", "reference", "fast"],
                        help="reference: the plain-PyTorch decode (CPU or GPU); fast: the Triton/CUDA-graph "
                             "step (CUDA only); auto: fast on cuda, reference on cpu")
    parser.add_argument("--prefill-block", type=int, default=1,
                        help="fast engine: prompt tokens of a sequence per step (a causal block; e.g. 16)")
    parser.add_argument("--hbm-budget", type=budget_arg, default=None, metavar="GB|auto",
                        help="fast engine: GB of device memory for weights; the coldest routed experts (by "
                             "--routing-profile, else uniform) stay in page-locked host memory; auto: what the "
                             "device has free, less the state of --max-seqs and a margin")
    parser.add_argument("--routing-profile", default=None, help="a `megastep profile-routing` JSON for --hbm-budget")
    parser.add_argument("--cold-path", default="gpu", choices=["gpu", "cpu", "hybrid"],
                        help="with --hbm-budget: the GPU reads cold experts in host memory, the CPU computes them, "
                             "or both share them")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for the model (default: cores - 1, leaving one for HTTP)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _model_dir(args: argparse.Namespace):
    """(checkpoint directory, default served name) of --model, or the built-in model's."""
    from pathlib import Path

    from megastep.errors import UserError

    if args.model is None:
        from megastep.builtin import builtin_model_dir
        return Path(builtin_model_dir()), "megastep-builtin"
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UserError(f"--model {model_dir}: no such directory")
    return model_dir, model_dir.resolve().name


def build_engine(args: argparse.Namespace, model_dir, rank=None):
    """The engine --engine / --device ask for; with `rank` (runtime.distributed.Rank) this rank's
    part of the expert-parallel fast engine on its GPU. Raises UserError on a bad setup."""
    import torch

    from megastep.errors import UserError
    from megastep.runtime.engine import FastEngine, ReferenceEngine

    device = str(rank.device) if rank is not None else (args.device or "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device must be cpu or cuda[:N], got {device!r}")
    kind = args.engine if args.engine != "auto" else (
        "fast" if device.startswith("cuda") or rank is not None else "reference")
    if args.prefill_block < 1:  # (only the fast engine reads it; refused for either)
        raise UserError(f"--prefill-block must be >= 1, got {args.prefill_block}")
    if kind == "fast":
        if not device.startswith("cuda") and rank is None:
            raise UserError("--engine fast needs --device cuda")
        ep = {} if rank is None else {"rank": rank.rank, "world_size": rank.world_size}
        return FastEngine(model_dir, device=device, max_seqs=args.max_seqs, max_block=args.prefill_block,
                          hbm_budget_gb=args.hbm_budget, routing_profile=args.routing_profile,
                          cold_path=args.cold_path, **ep), kind, device
    if args.hbm_budget is not None or args.routing_profile is not None:
        raise UserError("--hbm-budget / --routing-profile place experts for the fast engine (--engine fast)")
    return ReferenceEngine(model_dir, device=device), kind, device


def build_server(args: argparse.Namespace, rank=None):
    """Load the model and build (scheduler, FastAPI app, context). Raises UserError on a bad setup.
    With `rank` (rank 0 of an expert-parallel run) the engine is that rank's part."""
    from megastep.errors import UserError
    from megastep.runtime.scheduler import Scheduler
    from megastep.server.app import ServerContext, create_app
    from megastep.server.chat import ChatRenderer
    from megastep.tokenizer import load_tokenizer

    log = logging.getLogger("megastep.server")
    model_dir, default_name = _model_dir(args)
    for flag, v, lo in (("--max-seqs", args.max_seqs, 1), ("--chunk", args.chunk, 1),
                        ("--queue-limit", args.queue_limit, 1), ("--default-max-tokens", args.default_max_tokens, 1)):
        if v < lo:
            raise UserError(f"{flag} must be >= {lo}, got {v}")
    if args.capacity is not None and args.capacity < 16:
        raise UserError(f"--capacity must be >= 16 tokens, got {args.capacity}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    import os

    import torch

    # The event loop needs a core of its own: an OpenMP pool spread over every core stalls each
    # step whenever the HTTP side (or anything else) holds one of them.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    engine, kind, device = build_engine(args, model_dir, rank)
    ep = ""
    if rank is not None:
        heads = getattr(getattr(engine, "decoder", None), "split_peer", None) is not None
        ep = f", experts{' and attention heads' if heads else ''} split over {rank.world_size} GPUs"
    log.info("loaded %s in %.1f s (%s engine on %s%s, %d torch threads)", model_dir,
             time.perf_counter() - t0, kind, device, ep, torch.get_num_threads())
    try:
        scheduler = Scheduler(engine, max_seqs=args.max_seqs, capacity=args.capacity, chunk=args.chunk,
                              queue_limit=args.queue_limit)
    except ValueError as e:
        raise UserError(str(e)) from None
    source = ("--capacity" if args.capacity is not None else
              "free device memory after weights, capped at max-seqs x the model's max length"
              if device.startswith("cuda") else "CPU default: up to 4096 tokens per slot")
    log.info("%s [sized from %s]", scheduler.describe_pool(), source)
    renderer = ChatRenderer(model_dir)
    log.info("chat: %s", renderer.kind)
    ctx = ServerContext(scheduler=scheduler, tokenizer=tokenizer, renderer=renderer,
                        model_name=args.served_model_name or default_name,
                        chat_default_max_tokens=args.default_max_tokens, created=int(time.time()))
    return scheduler, create_app(ctx), ctx


def _logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_http(args: argparse.Namespace, scheduler, app, ctx) -> None:
    import uvicorn

    scheduler.start()
    logging.getLogger("megastep.server").info("serving %r on http://%s:%d/v1", ctx.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=args.access_log, timeout_graceful_shutdown=5)
    finally:
        scheduler.shutdown()


def check_gpus(args: argparse.Namespace) -> list[int]:
    """The GPU ids of --gpus, after checking everything that can be checked before the processes
    start (flags, the checkpoint's expert count, the devices). Raises UserError."""
    import torch

    from megastep.checkpoint.loader import scan_checkpoint
    from megastep.errors import UserError
    from megastep.runtime import distributed as D

    gpus = D.parse_gpus(args.gpus)
    if args.device is not None:
        raise UserError("--gpus puts one process on each GPU it names: drop --device")
    if args.engine == "reference":
        raise UserError("--gpus runs the fast engine: drop --engine reference")
    if args.hbm_budget is not None or args.routing_profile is not None:
        raise UserError("--gpus holds every routed expert in device memory: drop --hbm-budget / --routing-profile")
    scan = scan_checkpoint(_model_dir(args)[0])
    scan.raise_if_invalid(require_mtp=False)
    D.check_world_size(scan.cfg.n_routed_experts, len(gpus))
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(gpus) >= n:
        raise UserError(f"--gpus {args.gpus}: this machine has {n} CUDA device{'s' * (n != 1)}")
    return gpus


def _serve_rank(rank, args: argparse.Namespace) -> None:
    """One process of `serve --gpus`: rank 0 serves HTTP and drives the engine; the others follow."""
    _logging(args)
    if rank.rank == 0:
        scheduler, app, ctx = build_server(args, rank)
        try:
            _run_http(args, scheduler, app, ctx)
        finally:
            scheduler.engine.close()
    else:
        engine, _, _ = build_engine(args, _model_dir(args)[0], rank)
        engine.follow()


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until interrupted. Returns a process exit code."""
    _logging(args)
    from megastep.errors import UserError

    try:
        if not 0 <= args.port <= 65535:  # before the model loads (the socket would refuse it only after)
            raise UserError(f"--port must be in 0..65535, got {args.port}")
        if args.gpus:
            import signal

            from megastep.runtime import distributed as D

            gpus = check_gpus(args)
            # a terminated server stops its rank processes too (launch's cleanup runs on SystemExit)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            D.launch(_serve_rank, len(gpus), (args,), backend="nccl", gpus=gpus, timeout_s=None)
            return 0
        scheduler, app, ctx = build_server(args)
    except UserError as e:
        print(f"megastep serve: {e}", file=sys.stderr)
        return 2
    _run_http(args, scheduler, app, ctx)
    return 0
