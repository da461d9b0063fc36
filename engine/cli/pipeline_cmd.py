"""`flotilla pipeline`: run a model as a pipeline of local stage processes and chat.

    flotilla pipeline --model demo --stages 3 -p "Hello" --exact --max-tokens 64
    flotilla pipeline --model demo --split 0:3,3:6,6:8      # REPL without -p
    flotilla pipeline --model ~/models/Llama-3.1-8B --weights int4 --plan-only

Plans (an even split over equal local peers, or --split) at the weight
precision asked (--weights auto: the most precise at which the plan fits, from
the checkpoint's own dtype down), prints that plan, then exports/caches the
shards at its precision, starts one worker process per stage on loopback,
chats through them like `flotilla chat` (tok/s after each answer) and stops
every process on exit, on Ctrl-C and on errors. A plan that does not fit is
refused with its stage named before anything is exported.
"""

from __future__ import annotations

import argparse
import signal
import sys

from engine.cli.chat_cmd import (add_sampling_arguments, add_speculative_arguments, chat_session, sampling_from_args,
                                 speculative_from_args)
from engine.cli.errors import UserError
from engine.cli.progress import TerminalProgress

# The labels engine/planner/weights.py accepts (kept here so --help needs no numpy import).
WEIGHT_CHOICES = ("auto", "f32", "bf16", "fp16", "int8", "int4")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="run a model as a pipeline of local stage processes and chat with it")
    p.add_argument("--model", "-m", default="demo",
                   help="demo id, local HF folder or hub id (default: demo)")
    p.add_argument("--stages", type=int, default=2, help="stage processes, layers split evenly (default 2)")
    p.add_argument("--split", help="explicit layer ranges in ring order, e.g. 0:3,3:6,6:8 (overrides --stages)")
    p.add_argument("--exact", action="store_true",
                   help="f32 math and KV cache on every stage (matches transformers exactly; slower)")
    p.add_argument("--device", default="CPU", help="OpenVINO device of every stage (default: CPU)")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="shard weight precision; auto (default) = the most precise at which the plan fits, "
                        "starting at the checkpoint's own dtype")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="tokens of KV cache reserved per stream (default: the model's trained context)")
    p.add_argument("--plan-only", action="store_true",
                   help="print the plan (stages, weights, memory per stage) and exit without exporting")
    p.add_argument("--threads", type=int, default=None,
                   help="OpenVINO inference threads per stage (default: the plugin's choice)")
    p.add_argument("--max-streams", type=int, default=8, help="streams in the ring at once (default 8)")
    p.add_argument("--exact-prompt-cache", action="store_true",
                   help="a follow-up turn reuses the stages' KV in whole prefill chunks only, and the stages "
                        "keep a 16-bit KV cache, so its greedy answer is the one a fresh request gets at any "
                        "precision (costs up to 512 tokens of prefill a turn)")
    p.add_argument("--plaintext", action="store_true",
                   help="no CURVE between the local stages (loopback only; default: encrypted like a fleet)")
    p.add_argument("-p", "--prompt", help="answer this one prompt and exit (default: an interactive chat)")
    p.add_argument("--system", help="a system prompt")
    add_sampling_arguments(p)
    add_speculative_arguments(p)
    p.set_defaults(func=cmd_pipeline)


def fleet_config_from_args(args: argparse.Namespace):
    from engine.planner.plan import PlanError
    from engine.pipeline.runner import FleetConfig, parse_split

    try:
        split = parse_split(args.split) if args.split else None
    except PlanError as e:
        raise UserError(str(e)) from None
    if args.stages < 1:
        raise UserError("--stages must be at least 1")
    context = getattr(args, "context", None)
    if context is not None and context < 1:
        raise UserError("--context must be at least 1 token")
    if args.max_streams < 1:
        raise UserError("--max-streams must be at least 1")
    return FleetConfig(model=args.model, stages=args.stages, split=split, exact=args.exact, device=args.device,
                       weights=args.weights, threads=args.threads, max_concurrent=args.max_streams,
                       context_length=context, curve=not getattr(args, "plaintext", False),
                       prompt_cache_exact=getattr(args, "exact_prompt_cache", False))


class _PlanShown(Exception):
    """--plan-only: the plan was printed; stop before anything is exported."""


def cmd_pipeline(args: argparse.Namespace) -> int:
    from engine.planner.plan import PlanError
    from engine.planner.weights import describe_plan
    from engine.pipeline.runner import launch_pipeline

    sampling = sampling_from_args(args)  # validate before the (slow) start
    cfg = fleet_config_from_args(args)
    # SIGTERM becomes SystemExit so the finally below stops the stage processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    progress = TerminalProgress()
    plan_only = getattr(args, "plan_only", False)

    def show(plan) -> None:
        progress.close()
        out = sys.stdout if plan_only else sys.stderr
        names = {s.peer_id: f"this PC #{i + 1}" for i, s in enumerate(plan.stages)}
        print("\n".join(describe_plan(plan, names, chosen=cfg.weights)), file=out, flush=True)
        if plan_only:
            raise _PlanShown()

    try:
        engine = launch_pipeline(cfg, progress, speculative=speculative_from_args(args), on_plan=show)
    except _PlanShown:
        return 0
    except PlanError as e:
        raise UserError(str(e)) from None
    finally:
        progress.close()
    try:
        for link in engine.stages:
            print(f"  {link.label} at {link.endpoint}", file=sys.stderr)
        return chat_session(engine, args, sampling, f"through {len(engine.stages)} stages")
    finally:
        engine.close()
