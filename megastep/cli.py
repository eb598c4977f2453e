"""`megastep generate | inspect | make-checkpoint | profile-routing | bench | serve`.

A `UserError` (bad checkpoint, bad prompt, bad flag value) ends the command with one line on
stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megastep.errors import UserError, check_output_file, check_output_folder, comma_ints, writing


def _model_dir(arg: str | None) -> Path:
    if arg is not None:
        d = Path(arg).expanduser()
        if not d.exists():  # said before any other check of what the folder lacks (its tokenizer, say)
            raise UserError(f"model directory {d} does not exist")
        return d
    from megastep.builtin import builtin_model_dir

    return builtin_model_dir()


def _parse_ids(text: str) -> list[int]:
    return comma_ints(text, f"--prompt-ids must be comma-separated integers, got {text!r}")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda requested but no CUDA device is available")
    return torch.device(name)


def cmd_generate(args: argparse.Namespace) -> int:
    from megastep.checkpoint.loader import load_checkpoint
    from megastep.model.reference import ReferenceModel
    from megastep.runtime.scheduler import SamplingParams, sample_token
    from megastep.server.text import IncrementalDetokenizer
    from megastep.tokenizer import load_tokenizer

    if args.max_new_tokens < 0:
        raise UserError("--max-new-tokens must be >= 0")
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    if not 0.0 < args.top_p <= 1.0:  # the server's rule for top_p
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0: no cut), got {args.top_k}")
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give either a PROMPT or --prompt-ids (not both)")
    model_dir = _model_dir(args.model)
    device = _device(args.device)
    cfg, weights = load_checkpoint(model_dir, device=device, progress=not args.print_ids)
    tok = load_tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() or args.prompt is not None else None
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("empty prompt: give some text")
        ids = tok.encode(args.prompt)
        if tok.bos_id is not None:
            ids = [tok.bos_id] + ids  # a document starts with BOS, as in the V4 chat format
    else:
        ids = _parse_ids(args.prompt_ids)
        if not ids:
            raise UserError("empty prompt: --prompt-ids holds no token id")
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UserError(
            f"prompt of {len(ids)} tokens plus {args.max_new_tokens} new tokens exceeds the model's limit of "
            f"{cfg.max_position_embeddings} tokens"
        )

    model = ReferenceModel(cfg, weights, quant_sim=not args.no_quant_sim)
    state = model.new_state()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    detok = IncrementalDetokenizer(tok.decode) if tok is not None else None
    logits = model.forward(state, ids)[-1]
    out: list[int] = []
    for i in range(args.max_new_tokens):
        t = sample_token(logits, params, gen)
        out.append(t)
        if detok is not None and not args.print_ids:
            sys.stdout.write(detok.push(t))
            sys.stdout.flush()
        if t == cfg.eos_token_id:
            break
        if i + 1 < args.max_new_tokens:
            logits = model.forward(state, [t])[-1]
    if detok is not None and not args.print_ids:
        sys.stdout.write(detok.flush() + "\n")
    if args.print_ids:
        if tok is not None:
            print(tok.decode(out))
        print(",".join(str(t) for t in out))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from megastep.checkpoint.loader import describe_plan

    print(describe_plan(Path(args.model_dir)))
    if args.hbm_budget is not None:
        from megastep.runtime.experts import describe_with_budget

        if args.hbm_budget < 0:
            raise UserError("--hbm-budget must be >= 0 (GB)")
        print(describe_with_budget(Path(args.model_dir), args.hbm_budget, args.routing_profile))
    elif args.routing_profile is not None:
        raise UserError("--routing-profile needs --hbm-budget")
    return 0


def cmd_profile_routing(args: argparse.Namespace) -> int:
    from megastep.routing import collect_routing_profile, profile_summary, save_profile
    from megastep.tokenizer import load_tokenizer

    model_dir = _model_dir(args.model)
    check_output_file(args.out, "--out")
    prompts = [_parse_ids(p) for p in args.prompt_ids]
    if args.prompts:
        tok = load_tokenizer(model_dir)
        for f in args.prompts:
            try:
                text = Path(f).read_text()
            except OSError as e:
                raise UserError(f"cannot read prompt file {f}: {e.strerror}") from None
            ids = tok.encode(text)
            prompts.append(([tok.bos_id] if tok.bos_id is not None else []) + ids)
    prompts = [p for p in prompts if p]
    if not prompts:
        raise UserError("no prompt: give --prompts FILE... or --prompt-ids 1,2,3")
    profile = collect_routing_profile(model_dir, prompts, max_new_tokens=args.max_new_tokens,
                                      device=_device(args.device), quant_sim=not args.no_quant_sim)
    print(profile_summary(profile))  # (first: a profile that cannot be written is not lost)
    with writing(f"the profile to {args.out}"):
        save_profile(profile, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from megastep.checkpoint.synthetic import PRESETS, preset, write_checkpoint

    if args.preset not in PRESETS:
        raise UserError(f"unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}")
    if args.layers is not None and args.layers < 1:
        raise UserError("--layers must be >= 1")
    check_output_folder(args.out, "--out")
    cfg = preset(args.preset, layers=args.layers)
    with writing(f"the checkpoint to {args.out}"):
        write_checkpoint(cfg, Path(args.out), seed=args.seed, unquantized=args.unquantized, routing=args.routing)
    print(f"wrote {args.preset} checkpoint ({cfg.num_hidden_layers} layers, seed {args.seed}) to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megastep", description="Decode runtime for DeepSeek-V4-family MoE models")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with the reference decode")
    g.add_argument("prompt", nargs="?", help="prompt text")
    g.add_argument("--model", help="checkpoint directory (default: the built-in tiny synthetic model)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-ids", help="comma-separated token ids instead of PROMPT")
    g.add_argument("--print-ids", action="store_true", help="print the generated ids on the last line")
    g.add_argument("--no-quant-sim", action="store_true", help="switch off the activation-quantization simulations")
    g.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect", help="print the model plan of a checkpoint")
    i.add_argument("model_dir")
    i.add_argument("--hbm-budget", type=float, metavar="GB", help="also plan hot experts in HBM / cold in host memory")
    i.add_argument("--routing-profile", metavar="JSON", help="routing profile for the plan (default: uniform)")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("profile-routing", help="per-layer expert selection counts over prompts -> JSON")
    r.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    r.add_argument("--prompts", nargs="+", default=[], metavar="FILE", help="text files, one prompt each")
    r.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated ids (repeatable)")
    r.add_argument("--max-new-tokens", type=int, default=0, help="also decode greedily this many tokens per prompt")
    r.add_argument("--device", default="cpu")
    r.add_argument("--no-quant-sim", action="store_true")
    r.add_argument("--out", required=True)
    r.set_defaults(func=cmd_profile_routing)

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the official format")
    m.add_argument("--preset", required=True)
    m.add_argument("--layers", type=int)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--unquantized", action="store_true", help="bf16 weights, no quantization_config")
    m.add_argument("--routing", choices=("default", "uniform", "skewed"), default="default",
                   help="gate bias: as generated, uniform, or the skewed model of docs (top 25%% of experts ~2/3 of slots)")
    m.add_argument("--out", required=True)
    m.set_defaults(func=cmd_make_checkpoint)

    from megastep.bench import add_bench_arguments, bench_main

    b = sub.add_parser("bench", help="decode-step latency of the fast path (CUDA) vs the roofline and transformers")
    add_bench_arguments(b)
    b.set_defaults(func=bench_main)

    from megastep.server import add_serve_arguments, serve_main

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(s)
    s.set_defaults(func=serve_main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"megastep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
