"""The ``mmflax`` command line: ``demo``, ``train``, ``launch``, ``sample`` and ``export``.

* ``mmflax train`` trains the tiny GPT pipelined over 2 stages x (2 data x 2 tensor) on 8
  simulated CPU devices (real devices on a GPU host) with 4 microbatches under 1F1B, and
  writes a run folder: ``metrics.json``, ``loss.png``, ``timeline.png``, ``samples.txt`` and
  an orbax ``checkpoint/``. ``--resume`` continues a run, on the same or another layout.
  ``--layers-per-stage 1,3,3,1`` splits the blocks unevenly between the stages (its length
  is the stage count; the stem goes with the first stage, the head with the last).
  ``--init-from HF_DIR`` fine-tunes a Hugging Face GPT-2/Llama/Qwen/Mistral checkpoint instead
  (`models.hf`), on any stage layout, tokenizing with its ``tokenizer.json`` when it has one.
  ``--dataset PATH`` trains on the user's own ``.txt``/``.jsonl``/``.parquet`` files instead
  of the shipped corpus (`_data`), ``--eval-fraction F`` holding part of them out. The
  fine-tuning recipe: ``--lr-schedule cosine``, ``--clip-norm``, ``--grad-accum K``
  (`_optimizer`), ``--precision`` and ``--recompute`` (``parallelize_step``'s), and
  ``--tensorboard`` (`_tensorboard`).
* ``mmflax train --processes N`` runs the same training as N local processes of one
  ``jax.distributed`` job (``--devices`` split between them); ``mmflax launch -n N
  [--devices-per-process K] -- COMMAND...`` runs any such script (`multimesh_flax.distributed`).
* ``mmflax plan --model gpt-small --devices 8 --memory 2GiB`` ranks layouts by predicted
  step time (`_plan`, `multimesh_flax.plan`); ``mmflax train --plan auto`` trains the best
  one and puts its predictions beside what the run measured (metrics.json ``plan``).
* ``mmflax sample --checkpoint RUN_DIR`` generates text from a run's latest checkpoint.
* ``mmflax export --checkpoint RUN_DIR --to HF_DIR`` writes it as a Hugging Face folder.
* ``mmflax demo`` (also plain ``mmflax``) runs the placement demo: a two-layer function on
  two submeshes, printing where every array lives.

Bad arguments print ``mmflax: <message>`` to stderr and exit with status 2, never a
traceback; a failed ``--check-reference``, a non-finite loss or a checkpoint that cannot be
written (a read-only folder, a full disk) exits with status 1.
``mmflax train`` stopped by SIGINT or SIGTERM finishes the step in flight, saves, says where
and exits with 130 or 143 (128 + the signal); ``--resume`` continues it. The work lives in `_train`,
`_sample`, `_export` and `_demo`; this module parses, sets up the devices and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

_DEFAULT_DEVICES = 8


class _ArgumentError(Exception):
    """A command-line mistake found by argparse."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage and exit
        raise _ArgumentError(f"{message} (see `{self.prog} --help`)")


def _configure_devices(count: int, *, accelerators: bool = False) -> None:
    """Gives the CPU backend ``count`` simulated devices, before any JAX operation.

    With ``accelerators`` and ``JAX_PLATFORMS`` unset, JAX picks its default backend (a GPU
    when there is one); otherwise the CPU. If JAX already started in this process (tests,
    notebooks), this is a no-op when it has ``count`` CPU devices.

    Raises:
        RunOptionError: JAX already started with a different number of CPU devices.
    """
    import jax

    from multimesh_flax.cli.errors import RunOptionError

    platforms = os.environ.get("JAX_PLATFORMS")
    pin_cpu = platforms == "cpu" or (platforms is None and not accelerators)
    try:
        if pin_cpu:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backends are up already
        devices = jax.devices()
        if devices[0].platform == "cpu" and len(devices) != count:
            raise RunOptionError(
                f"JAX already runs with {len(devices)} CPU devices in this process, so "
                f"`--devices` {count} cannot take effect. Pass `--devices {len(devices)}`, or "
                "run `mmflax` in a fresh process."
            ) from None


def _add_train(sub: Any) -> None:
    from models import CORPUS_NAMES, PRESETS
    from multimesh_flax.cli._run_options import ON_NONFINITE, SCHEDULES, TrainOptions

    d = TrainOptions()
    train = sub.add_parser(
        "train",
        help="train a reference model pipelined over a MultiMesh",
        description="Train a reference model pipelined over stages x (data x tensor) devices "
        "and write a run folder (metrics.json, loss.png, timeline.png, samples.txt, "
        "checkpoint/). Settings not given default to the value shown, or with --resume to "
        "the resumed run's.",
    )
    add = train.add_argument
    add("--model", help=f"model preset: {', '.join(PRESETS)} ({d.model})")
    add("--layers", type=int, help="transformer blocks (default: the preset's)")
    add("--stages", type=int, help=f"pipeline stages; must divide the layers ({d.stages})")
    add(
        "--layers-per-stage",
        type=_layers_per_stage,
        metavar="N,N,...",
        help="the blocks of every stage, e.g. 1,3,3,1 for 8 layers on 4 stages: an uneven "
        "split instead of --stages (its length is the stage count); only the first stage "
        "(with the embedding) and the last (with the head) may hold 0 (default: even)",
    )
    add(
        "--plan",
        choices=("auto",),
        help="choose the layout with the planner (`mmflax plan`): blocks per stage, data, "
        "tensor, microbatches, schedule and recomputation of the fastest predicted plan that "
        "fits --memory; after training, predicted and measured step time and memory are "
        "printed and stored in metrics.json under 'plan'",
    )
    add("--memory", metavar="SIZE", help="with --plan auto: memory per device, e.g. 2GiB")
    add("--data", type=int, help=f"data-parallel replicas per stage ({d.data})")
    add("--tensor", type=int, help=f"tensor-parallel devices per replica ({d.tensor})")
    add("--microbatches", type=int, help=f"microbatches per step ({d.microbatches})")
    add("--schedule", choices=SCHEDULES, help=f"pipeline schedule ({d.schedule})")
    add("--steps", type=int, help=f"optimizer steps to run now ({d.steps})")
    add("--batch-size", type=int, help=f"sequences per step ({d.batch_size})")
    add("--seq-len", type=int, help=f"tokens per sequence ({d.seq_len})")
    add("--lr", type=float, help=f"AdamW learning rate after warm-up ({d.lr})")
    add("--warmup", type=int, help=f"linear warm-up steps ({d.warmup})")
    _add_recipe(add, d)
    add("--seed", type=int, help=f"seed of parameters and batches ({d.seed})")
    add("--corpus", help=f"shipped corpus: {', '.join(CORPUS_NAMES)} ({d.corpus})")
    add(
        "--dataset",
        metavar="PATH",
        help="train on your own text instead of --corpus: a .txt file (one document), a .jsonl "
        "file (one JSON object per line), a .parquet file, or a folder of such files; "
        "tokenized once into the run folder's data_cache/, packed into --seq-len + 1 windows "
        "with an end-of-text id between documents",
    )
    add(
        "--text-field",
        metavar="NAME",
        help=f"the JSONL field / Parquet column holding the text ({d.text_field})",
    )
    add(
        "--eval-fraction",
        type=float,
        metavar="F",
        help="hold out this share (0 < F < 1) of --dataset's windows and report the held-out "
        "loss and perplexity before and after training (default: none)",
    )
    add(
        "--eval-every",
        type=int,
        metavar="N",
        help="also evaluate every N steps (default: before and after training only)",
    )
    add("--out", help="run folder (default: runs/<date-time>; with --resume: the newest run)")
    add("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    add(
        "--init-from",
        metavar="HF_DIR",
        help="fine-tune a Hugging Face GPT-2/Llama/Qwen/Mistral folder (config.json + "
        "safetensors) instead of training --model from scratch; its tokenizer.json is used "
        "when present",
    )
    add(
        "--check-reference",
        action="store_true",
        help="also train the unstaged model on one device on the same batches; exit 1 unless "
        "the first 20 losses agree to 1e-4 (relative)",
    )
    add("--log-every", type=int, help=f"steps between loss read-outs ({d.log_every})")
    add(
        "--on-nonfinite",
        choices=ON_NONFINITE,
        help="at a NaN/inf loss or gradient norm: stop (exit 1, naming the step; the last "
        f"finite state is saved) or skip that step's update ({d.on_nonfinite})",
    )
    add(
        "--save-every",
        metavar="N|DURATION",
        help=f"save a checkpoint every N steps or every DURATION of training (90s, 5m, 1h), "
        f"'end' for only at the end; a run always saves when it ends or is stopped by "
        f"SIGINT/SIGTERM ({d.save_every})",
    )
    add(
        "--devices",
        type=int,
        default=_DEFAULT_DEVICES,
        help="simulated CPU devices (8); a GPU host uses its GPUs unless JAX_PLATFORMS=cpu",
    )
    add(
        "--processes",
        type=int,
        default=argparse.SUPPRESS,  # absent unless given: the namespace stays the options
        help="run as this many local processes of one jax.distributed job, --devices split "
        "evenly between them (default: one process)",
    )
    _add_compile_cache(add)


def _add_plan(sub: Any) -> None:
    from models import PRESETS

    plan = sub.add_parser(
        "plan",
        help="plan a pipeline for a reference model: rank layouts by predicted step time",
        description="Profile a reference model's stem, block and head once (XLA's cost and "
        "memory analysis; nothing runs in the default analytic mode) and rank the layouts of "
        "--devices devices by predicted step time: blocks per stage, data x tensor per stage, "
        "schedule, microbatches, recomputation. Only plans that fit --memory are shown.",
    )
    add = plan.add_argument
    add("--model", default="gpt-tiny", help=f"model preset: {', '.join(PRESETS)} (gpt-tiny)")
    add("--layers", type=int, help="transformer blocks (default: the preset's)")
    add("--devices", type=int, default=_DEFAULT_DEVICES, help="devices to plan for (8)")
    add("--memory", metavar="SIZE", help="memory per device, e.g. 2GiB (default: no limit)")
    add("--batch-size", type=int, default=32, help="sequences per step (32)")
    add("--seq-len", type=int, default=64, help="tokens per sequence (64)")
    add(
        "--schedules",
        type=_names,
        help="comma-separated schedules (default: gpipe, 1f1b, zero-bubble-h1, zero-bubble-h2)",
    )
    add("--microbatches", type=_counts, help="comma-separated counts (default: 1, 2, 4, .. 64)")
    add(
        "--recompute",
        type=_names,
        default=("none", "full"),
        help="comma-separated policies a stage may use: none, full, dots (none,full)",
    )
    add(
        "--per-stage-recompute",
        action="store_true",
        help="let stages recompute differently (`mmflax train` applies one policy to all)",
    )
    add(
        "--mode",
        choices=("analytic", "measured"),
        default="analytic",
        help="analytic: XLA's analysis only; measured: also time each unit here (analytic)",
    )
    add(
        "--device",
        choices=("cpu", "h100", "h200"),
        default="cpu",
        help="the device whose data sheet prices analytic times and transfers (cpu)",
    )
    add("--top", type=int, default=10, help="plans to show (10)")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected counts separated by commas, e.g. 4,8, got {text!r}"
        ) from None


def _layers_per_stage(text: str) -> tuple[int, ...]:
    """``--layers-per-stage``: comma-separated block counts, one per stage, each >= 0."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected block counts separated by commas, one per stage (e.g. 1,3,3,1), got {text!r}"
        ) from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"expected counts >= 0, got {text!r}")
    return counts


def _clip_norm(text: str) -> float:
    """``--clip-norm``: a number, or ``none`` (0: no clipping)."""
    if text.strip().lower() == "none":
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number >= 0 or 'none' (no clipping), got {text!r}"
        ) from None


def _add_recipe(add: Any, d: Any) -> None:
    """The fine-tuning recipe: schedule, clipping, accumulation, precision, recomputation."""
    from multimesh_flax.cli._optimizer import LR_SCHEDULES
    from multimesh_flax.cli._run_options import PRECISIONS, RECOMPUTE

    add(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        help="the rate after warm-up: constant, or cosine decay to --min-lr-ratio x --lr at "
        f"the run's last step ({d.lr_schedule})",
    )
    add(
        "--min-lr-ratio",
        type=float,
        metavar="R",
        help=f"final rate of --lr-schedule cosine as a share of --lr, 0 <= R <= 1 "
        f"({d.min_lr_ratio})",
    )
    add(
        "--clip-norm",
        type=_clip_norm,
        metavar="X",
        help=f"clip the gradient's global norm to X; 0 or 'none' clips nothing ({d.clip_norm})",
    )
    add(
        "--grad-accum",
        type=int,
        metavar="K",
        help="average the gradients of K consecutive batches of --batch-size into one "
        "update: --steps counts updates, each reading K batches (run as K x --microbatches "
        f"microbatches of one step) ({d.grad_accum})",
    )
    add(
        "--precision",
        choices=PRECISIONS,
        help="fp32; bf16: bfloat16 compute (activations, stage-to-stage transfers), float32 "
        "parameters and optimizer state; pure-bf16: bfloat16 state too "
        f"({d.precision})",
    )
    add(
        "--recompute",
        choices=RECOMPUTE,
        help="what the backward recomputes instead of keeping: none, full (each stage keeps "
        "only its inputs) or dots (keeps matrix products too); the same numbers, less "
        f"activation memory ({d.recompute})",
    )
    add(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        help="write TensorBoard event files to <out>/tensorboard/: loss, learning rate, "
        "gradient norm, tokens/s, held-out loss and perplexity (default: off; a resumed run "
        "keeps its setting)",
    )
    add(
        "--samples",
        action=argparse.BooleanOptionalAction,
        help="generate text before and after training into <out>/samples.txt (default: on; "
        "--no-samples saves four compiled generations, e.g. for large models)",
    )


def _add_launch(sub: Any) -> None:
    launch = sub.add_parser(
        "launch",
        help="run a command as N local processes of one jax.distributed job",
        description="Start N copies of COMMAND, each with K simulated CPU devices, joined "
        "through a coordinator on a free loopback port (the script calls "
        "multimesh_flax.distributed.initialize()). Output is prefixed with [rank]; the exit "
        "status is non-zero if any process fails.",
    )
    launch.add_argument("-n", "--processes", type=int, required=True, help="processes")
    launch.add_argument(
        "--devices-per-process", type=int, default=4, help="CPU devices per process (4)"
    )
    launch.add_argument("--timeout", type=float, help="seconds before every process is killed")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def _add_compile_cache(add: Any) -> None:
    add(
        "--compile-cache",
        metavar="DIR",
        help="persistent compilation cache: a later run of the same program compiles "
        "(almost) nothing; 'off' disables it (default: $MMFLAX_COMPILATION_CACHE, else "
        "~/.cache/multimesh_flax/jax)",
    )


def _add_sample(sub: Any) -> None:
    sample = sub.add_parser("sample", help="generate text from a run's checkpoint")
    add = sample.add_argument
    add("--checkpoint", required=True, metavar="RUN_DIR", help="run folder of `mmflax train`")
    add("--prompt", default="Shall I ", help="text to continue ('Shall I ')")
    add("--tokens", type=int, help="bytes to generate (default: up to the trained sequence length)")
    add("--temperature", type=float, default=0.8, help="0 is greedy (0.8)")
    add("--top-k", type=int, help="sample among the k likeliest bytes only")
    add("--seed", type=int, default=0, help="sampling seed (0)")
    _add_compile_cache(add)


def _add_export(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model folder"
    )
    add = export.add_argument
    add("--checkpoint", required=True, metavar="RUN_DIR", help="run folder of `mmflax train`")
    add("--to", required=True, metavar="HF_DIR", help="new folder to write")
    _add_compile_cache(add)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mmflax",
        description="multimesh_flax: pipelined training of the reference models (train), "
        "sampling from a run (sample), exporting it to Hugging Face format (export) and the "
        "placement demo (demo, the default).",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    demo = sub.add_parser("demo", help="place a two-layer function on two submeshes")
    demo.add_argument(
        "--devices", type=int, default=_DEFAULT_DEVICES, help="simulated CPU devices (even)"
    )
    _add_train(sub)
    _add_plan(sub)
    _add_sample(sub)
    _add_export(sub)
    _add_launch(sub)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    if args.devices < 2 or args.devices % 2:
        raise _ArgumentError(f"`--devices` must be an even number >= 2, got {args.devices}")
    _configure_devices(args.devices)
    from multimesh_flax.cli import _demo

    return _demo.run(args.devices)


def _run_train(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise _ArgumentError(f"`--devices` must be a positive number, got {args.devices}")
    from multimesh_flax import distributed

    if getattr(args, "processes", 1) != 1 and not distributed.launched():
        return _launch_train(args)
    if distributed.launched():
        distributed.initialize()
    else:
        _configure_devices(args.devices, accelerators=True)
    _enable_cache(args)
    from multimesh_flax.cli import _run_options, _train

    skip = ("command", "devices", "compile_cache", "processes", "argv", "plan", "memory")
    given = {k: v for k, v in vars(args).items() if k not in skip}
    planned = None
    if args.plan == "auto":
        planned, given = _auto_plan(given, args.memory)
    elif args.memory is not None:
        raise _ArgumentError("`--memory` goes with `--plan auto`")
    options = _run_options.resolve_options({**given, "resume": args.resume or None})
    _run_options.check_options(options, _device_count())  # fail before any tracing
    model = options.init_from or options.model
    if _device_rank() != 0:  # the other processes of a job train quietly
        options = dataclasses.replace(options, progress=False)
        result = _train.train(options, report=lambda _: None)
        return 0 if result.stopped_by is None else _print_stop(result)
    print(
        f"mmflax train: {model} on {options.layout_description}, "
        f"{options.microbatches} microbatches, {options.schedule}; run folder {options.out}"
    )
    result = _train.train(options, report=print)
    status = _print_result(result)
    if planned is not None and result.stopped_by is None:
        _report_plan(planned, result, options)
    return status


def _auto_plan(given: dict[str, Any], memory: str | None) -> tuple[Any, dict[str, Any]]:
    """The best plan for the run's model and batch on this host's devices, and the
    settings with its layout."""
    from multimesh_flax.cli import _plan
    from multimesh_flax.cli._run_options import TrainOptions

    fixed = ("stages", "layers_per_stage", "data", "tensor", "microbatches", "schedule")
    chosen = [k for k in (*fixed, "recompute") if given.get(k) is not None]
    if chosen or given.get("resume"):
        raise _ArgumentError(
            f"`--plan auto` chooses the layout itself; drop {', '.join(chosen) or '--resume'}"
        )
    d = TrainOptions()
    plans = _plan.plan_model(
        given.get("model") or d.model,
        given.get("layers"),
        devices=_device_count(),
        memory=memory,
        batch_size=given.get("batch_size") or d.batch_size,
        seq_len=given.get("seq_len") or d.seq_len,
        top=5,
    )
    plans.table()
    return plans.best, {**given, **_plan.planned_options(plans.best)}


def _report_plan(planned: Any, result: Any, options: Any) -> None:
    """Prints the plan's predictions beside the run's measurements; adds them to
    metrics.json as ``plan``."""
    from multimesh_flax.cli import _plan, _run_files

    tokens = options.rows_per_step * options.seq_len
    comparison = _plan.compare(planned, result.metrics, tokens)
    result.metrics["plan"] = comparison
    _run_files.write_metrics(result.run_dir, result.metrics)
    for line in _plan.describe_comparison(comparison):
        print(line)


def _run_plan(args: argparse.Namespace) -> int:
    from multimesh_flax.cli import _plan

    if args.devices < 1 or args.top < 1:
        raise _ArgumentError(
            f"`--devices` and `--top` must be >= 1, got {args.devices}, {args.top}"
        )
    plans = _plan.plan_model(
        args.model,
        args.layers,
        devices=args.devices,
        memory=args.memory,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        schedules=args.schedules,
        microbatches=args.microbatches,
        recompute=args.recompute,
        per_stage_recompute=args.per_stage_recompute,
        mode=args.mode,
        device=args.device,
        top=args.top,
    )
    plans.table()
    best = plans.best
    print(
        f"best: {mm_describe(best.plan)}; predicted step {best.step_time * 1e3:.3f} ms, "
        f"peak {best.max_peak_bytes:,} B per device ({best.sources['unit times']} unit times)"
    )
    print(
        f"train it: mmflax train --model {args.model} --plan auto"
        + (f" --memory {args.memory}" if args.memory else "")
        + f" (or --layers-per-stage {','.join(map(str, best.plan.layers_per_stage))})"
    )
    print(
        f"searched {plans.configurations} configurations in {plans.search_seconds:.2f} s "
        "after profiling"
    )
    return 0


def mm_describe(plan: Any) -> str:
    from multimesh_flax.planner._search import describe

    return describe(plan)


def _print_stop(result: Any) -> int:
    """Says where an interrupted run saved and how to go on; returns 130 or 143."""
    import signal

    from multimesh_flax.cli._interrupts import exit_status

    saved = (
        "nothing new to save"
        if result.saved_step is None
        else (f"saved step {result.saved_step} to {result.run_dir}/checkpoint/")
    )
    print(
        f"mmflax train: stopped by {result.stopped_by} after step {result.end_step}; {saved}. "
        f"Continue with `mmflax train --resume --out {result.run_dir}`.",
        file=sys.stderr,
    )
    return exit_status(signal.Signals[result.stopped_by])


def _device_rank() -> int:
    import jax

    return jax.process_index()


def _without_processes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    return out


def _launch_train(args: argparse.Namespace) -> int:
    """``mmflax train --processes N``: the same command in N launched processes."""
    from multimesh_flax import distributed
    from multimesh_flax.cli import _run_options

    if args.processes < 1 or args.devices % args.processes:
        raise _ArgumentError(
            f"`--processes` must be a positive divisor of `--devices` ({args.devices}), got "
            f"{args.processes}"
        )
    out = args.out or str(_run_options.fresh_run_dir())  # one run folder for every process
    result = distributed.launch(
        args.processes,
        train_command(args.argv, out),
        devices_per_process=args.devices // args.processes,
    )
    return result.returncode


def train_command(argv: list[str], out: str) -> list[str]:
    """The command each process of ``mmflax train --processes N`` runs (``argv``: the CLI's)."""
    argv = _without_processes(argv)
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", out]
    return [sys.executable, "-m", "multimesh_flax.cli", *argv]


def _run_launch(args: argparse.Namespace) -> int:
    from multimesh_flax import distributed

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise _ArgumentError("give the command to run after `--`, e.g. `-- python train.py`")
    result = distributed.launch(
        args.processes,
        command,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
    )
    return result.returncode


def _enable_cache(args: argparse.Namespace) -> None:
    from multimesh_flax._compilation_cache import enable_compilation_cache

    enable_compilation_cache(getattr(args, "compile_cache", None))


def _device_count() -> int:
    import jax

    return jax.device_count()


def _print_result(result: Any) -> int:
    from multimesh_flax.cli import _train

    if result.stopped_by is not None:
        return _print_stop(result)
    m = result.metrics
    s = m["summary"]
    print(
        f"steps {s['start_step']}->{s['end_step']}: loss {s['first_loss']:.3f} -> "
        f"{s['last_loss']:.3f} (mean of the last 10: {s['last_10_mean_loss']:.3f}), "
        f"{s['tokens_per_s']:,.0f} tokens/s, first step (compile) "
        f"{s['compile_s']:.1f}s, wall {s['wall_s']:.1f}s; XLA compiles {s['xla_compiles']}, "
        f"loaded from the compilation cache {s['compile_cache_hits']}"
    )
    if m["bubble"] is not None:
        b = m["bubble"]
        recorded = "n/a" if b["recorded"] is None else f"{b['recorded']:.3f}"
        print(
            f"pipeline bubble at step {b['step']}: recorded {recorded}, simulated "
            f"{b['simulated']:.3f} (measured costs), {b['simulated_unit_costs']:.3f} (unit costs)"
        )
        if b.get("simulated_overlapped_steps") is not None:
            print(
                f"  with steps overlapping (as the Zero Bubble paper counts) "
                f"{b['simulated_overlapped_steps']:.3f}; peak activation sets per submesh "
                f"{b['peak_activation_sets']}"
            )
    kind = "sampled (temperature 0.8)"
    for moment in ("before", "after"):
        sample = m["samples"][moment]
        if sample is None:  # --no-samples
            continue
        rate = sample["corpus_match_rate"][kind]
        print(f"sample {moment} training ({rate:.0%} of its 4-grams occur in the corpus):")
        print(f"  {sample['texts'][kind]!r}")
    names = ("metrics.json", "loss.png", "timeline.png", "samples.txt", "checkpoint/")
    names += ("tensorboard/",)
    # A multi-process job records no timeline (each process sees only its own ops).
    wrote = [n for n in names if (result.run_dir / n.rstrip("/")).exists()]
    print(f"wrote {result.run_dir}/: {' '.join(wrote)}")
    ref = m["reference"]
    if ref is None:
        return 0
    ok = ref["max_rel_diff"] <= _train.REFERENCE_TOLERANCE
    print(
        f"reference check (unstaged model, one device) over the first {ref['checked_steps']} "
        f"steps: max |loss difference| {ref['max_abs_diff']:.2e}, relative "
        f"{ref['max_rel_diff']:.2e} (tolerance {_train.REFERENCE_TOLERANCE:.0e}): "
        f"{'ok' if ok else 'FAILED'}"
    )
    print(
        f"  over all {s['end_step'] - s['start_step']} steps: relative "
        f"{ref['max_rel_diff_all_steps']:.2e} (float rounding differences grow with training); "
        f"mean loss of the last 10 steps {s['last_10_mean_loss']:.3f} vs "
        f"{ref['last_10_mean_loss']:.3f} unstaged"
    )
    return 0 if ok else 1


def _run_sample(args: argparse.Namespace) -> int:
    _configure_devices(_DEFAULT_DEVICES, accelerators=True)
    _enable_cache(args)
    from multimesh_flax.cli import _sample

    text = _sample.sample(
        args.checkpoint,
        args.prompt,
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    _configure_devices(_DEFAULT_DEVICES, accelerators=True)
    _enable_cache(args)
    from multimesh_flax.cli import _export

    folder = _export.export(args.checkpoint, args.to)
    print(f"wrote {folder}/ ({', '.join(sorted(p.name for p in folder.iterdir()))})")
    return 0


_COMMANDS = {
    "demo": _run_demo,
    "train": _run_train,
    "plan": _run_plan,
    "launch": _run_launch,
    "sample": _run_sample,
    "export": _run_export,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mmflax`` console script; returns the exit status."""
    from multimesh_flax import errors
    from multimesh_flax.cli.errors import NonFiniteTrainingError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv or ["demo"])
        args.argv = argv
        if args.command is None:
            raise _ArgumentError(
                "choose a command: demo, train, plan, sample, export or launch "
                "(see `mmflax --help`)"
            )
        return _COMMANDS[args.command](args)
    except (NonFiniteTrainingError, errors.CheckpointSaveError) as e:  # the arguments were fine
        print(f"mmflax: {e}", file=sys.stderr)
        return 1
    except (_ArgumentError, errors.MultiMeshError) as e:
        print(f"mmflax: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmflax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
