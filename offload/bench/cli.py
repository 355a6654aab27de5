"""`offload-bench` command line: parse, validate, run every strategy, report.

Run ``offload-bench --help`` for the options. Every strategy runs in its own fresh process
(see :mod:`offload.bench.worker`), in alternating order across ``--rounds``, warm-up steps
excluded from the timings; ``none`` always runs (it is the reference for overhead, memory
saved and the gradient check).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offload.bench import maxbatch, report, rows as rows_mod, strategies as strategies_mod
from offload.bench.result import KILLED_OOM, OUT_OF_MEMORY, TIMED_OUT, RunResult
from offload.bench.rows import Meta, Row
from offload.bench.runner import GradChecker, WorkerRunner, Workspace, schedule
from offload.bench.spec import RunSpec
from offload.bench.strategies import PUBLIC_STRATEGIES
from offload.bench.models import GPTConfig

if TYPE_CHECKING:  # rich is imported when main() runs: a missing one gets a clear message
    from rich.console import Console
    from rich.progress import Progress

__all__ = ["main", "build_parser"]

# The CPU default: activations must dominate the fixed per-tensor and arena costs (the
# 256 MiB staging arena, the heap the runtime keeps) so that each strategy's trade-off
# shows, and every strategy (auto with its profile and trial steps) must finish within 4
# minutes on 2 cores. Batch 1 (357 MiB saved, 1.3 s steps) showed NVMe offload saving 28%
# of memory against 78% at batch 8; batch 8 (2.66 GiB, 12-16 s steps) takes over 6 minutes
# for all rows. Batch 3 saves about 1 GiB per step (four times the staging arena) at 5-6 s
# a step.
CPU_DEFAULT_BATCH = 3
MODEL_DEFAULT_BATCH = 8  # --model's, on every device
_GPT_KEYS = {f.name for f in dataclasses.fields(GPTConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-bench",
        description="Measure activation strategies side by side: step time, peak activation "
                    "memory, bytes per tier, bandwidth, stall time and a bit-exact gradient "
                    "check against plain autograd ('none'). Each strategy runs in its own "
                    "process.",
        epilog="Strategies: " + "; ".join(f"{n}: {strategies_mod.get(n).description}"
                                          for n in PUBLIC_STRATEGIES)
               + ". OFFLOAD_* environment variables apply to the offload rows except the "
                 "tiers/policy/nvme_dir each row sets.")
    a = p.add_argument
    a("--strategies", default=",".join(PUBLIC_STRATEGIES),
      help="comma-separated subset to run (default: all); 'none' always runs")
    a("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    a("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
      help="fp32, or bf16 autocast (default: bf16 on CUDA, fp32 on CPU)")
    a("--batch", type=int, help=f"batch size (default: {CPU_DEFAULT_BATCH} on CPU, "
                                f"gpt_for_machine's on CUDA; {MODEL_DEFAULT_BATCH} with --model)")
    a("--seq", type=int, help="sequence length of the built-in GPT (default: its config's)")
    a("--gpt", metavar="K=V,...", action="append", default=[],
      help="override GPTConfig fields, e.g. hidden=1024,layers=12,heads=16 (repeatable: "
           "all apply, a key given again takes its last value)")
    a("--hf", metavar="TYPE|CONFIG.json",
      help="a Hugging Face causal LM built from transformers' config for TYPE (gpt2, llama, "
           "mistral, qwen2, ...; no download), sized like the built-in GPT (--gpt/--seq "
           "override), or from a config.json as written; inputs input_ids and labels")
    a("--model", metavar="MODULE:FACTORY",
      help="benchmark your model: FACTORY() returns an nn.Module; input torch.randn(batch, "
           "*input_shape); loss output.float().pow(2).mean() (of the first element of a "
           "tuple, list, dict or Hugging Face ModelOutput); accepts FILE.py:FACTORY")
    a("--input-shape", metavar="D1,D2,...",
      help="per-sample input shape for --model, e.g. 3,224,224")
    a("--input-vocab", type=int, metavar="N",
      help="--model takes token ids: its input is torch.randint(N, (batch, *input_shape)) "
           "instead of torch.randn")
    a("--steps", type=int, default=3, help="timed steps per run (default 3)")
    a("--warmup", type=int, default=1,
      help="untimed warm-up steps per run, at least 1 (default 1); auto also runs its profile "
           "and trial steps untimed")
    a("--rounds", type=int, default=1,
      help="run every strategy this many times, order reversed each round (default 1)")
    a("--seed", type=int, default=0, help="seed of the model's weights, the inputs and "
      "dropout, the same in every row (default 0)")
    a("--nvme-dir", help="where the NVMe rows write (a fresh subdirectory is made and "
                         "removed); default $OFFLOAD_NVME_DIR, else /var/tmp")
    a("--budget", help="OFFLOAD_BUDGET for the auto row, e.g. 4GiB or 30%%")
    a("--json", metavar="PATH",
      help="write the rows as JSON (one schema, versioned: docs/benchmarks.md)")
    a("--plot", metavar="PATH.png", help="scatter of memory against step time (matplotlib)")
    a("--explain", action="store_true", help="print the auto policy's plan")
    a("--max-batch", action="store_true",
      help="also find each strategy's largest batch that fits (slow: runs more workers)")
    a("--memory-limit", metavar="SIZE",
      help="--max-batch limit, e.g. 2GiB: required on CPU (checked against resident "
           "activation bytes), optional on CUDA (allocator peak)")
    a("--max-batch-cap", type=int, help="largest batch --max-batch tries (default 8x --batch)")
    a("--max-batch-time-s", type=float,
      help="time budget per strategy for --max-batch probes (default 180)")
    a("--timeout-s", type=float, default=1800.0,
      help="kill a worker after this many seconds (default 1800)")
    a("--plugin", metavar="MODULE", action="append", default=[],
      help="import MODULE (or FILE.py) first, in this process and every worker: it may "
           "add strategies with offload.bench.strategies.register(); repeatable")
    return p


@dataclass
class Settings:
    strategies: list[str]
    spec: RunSpec              # strategy field is a placeholder
    rounds: int
    nvme_bases: list[str]
    model_label: str
    seq_len: int | None
    json_path: str | None
    plot_path: str | None
    explain: bool
    max_batch: bool
    memory_limit_bytes: int | None
    max_batch_cap: int
    max_batch_time_s: float
    timeout_s: float
    preload: tuple[str, ...] = ()   # modules the workers' forkserver imports once


def _parse_strategies(text: str, parser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = strategies_mod.names()  # built-in ones and those --plugin registered
    if not names:
        parser.error("--strategies: empty list (choose from: " + ", ".join(known) + ")")
    for n in names:
        if n not in known:
            parser.error(f"--strategies: unknown strategy {n!r} "
                         f"(choose from: {', '.join(known)})")
    return ["none"] + [n for n in dict.fromkeys(names) if n != "none"]


def _parse_gpt(text: str, parser) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _GPT_KEYS:
            parser.error(f"--gpt {item!r}: expected KEY=VALUE with KEY one of "
                         f"{', '.join(sorted(_GPT_KEYS))}")
        try:
            out[key] = float(value) if key == "dropout" else int(value)
        except ValueError:
            parser.error(f"--gpt {item!r}: {value!r} is not a number")
    return out


def _nvme_bases(arg: str | None, parser) -> list[str]:
    from offload.config import Config
    from offload.config_parse import parse_nvme_dirs
    from offload.errors import ConfigError

    # The runtime's own rules for OFFLOAD_NVME_DIR ({rank}, {local_rank}, ~, commas).
    env = os.environ.get("OFFLOAD_NVME_DIR")
    text = arg or env or "/var/tmp"
    source = (f"--nvme-dir {arg!r}" if arg else f"OFFLOAD_NVME_DIR={env!r}" if env
              else "the default NVMe directory (set --nvme-dir)")
    try:
        bases = list(parse_nvme_dirs(text, source))
        # And its checks of the directories (they exist, are writable, on a file system
        # that is a disk: not /proc, /sys or ramfs), its messages naming `source`.
        # (Of the environment, only the capacity the runtime will reserve: the warning of a
        # RAM file system names it; the rest is checked with the rows' settings.)
        env = {name: os.environ[name] for name in ("OFFLOAD_NVME_BYTES",)
               if name in os.environ}
        config = Config.from_env(env=env, tiers="nvme", nvme_dir=",".join(bases))
        # The benchmark always writes there (the offload rows' workspace): nothing to drop.
        dataclasses.replace(config, sources={**config.sources, "nvme_dir": source}).validate(
            nvme_dir_alternative=None)
    except ConfigError as exc:
        parser.error(str(exc))
    return bases


def _check_runtime_settings(strategies: list[str], device, nvme_bases: list[str],
                            budget: str | None, parser) -> None:
    """Build the runtime's settings of every row that runs it, from this environment as its
    worker will: a bad OFFLOAD_* variable is a usage error now rather than "not available"
    rows after the run, and a warning (a misspelled variable) shows once here, not only in
    a worker's log, which is deleted."""
    from offload.config import Config
    from offload.errors import ConfigError

    off = []
    for name in strategies:
        strategy = strategies_mod.get(name)
        if not isinstance(strategy, strategies_mod.Offload):
            continue
        settings = strategy.kwargs(device, ",".join(nvme_bases), budget)
        del settings["model"]
        try:
            config = Config.from_env(**settings)
            config.validate()
        except ConfigError as exc:
            parser.error(str(exc))
        if not config.enabled:
            off.append(name)
    if off:
        parser.error(f"{config.where('enabled')} turns offload off, so the {', '.join(off)} "
                     "row(s) would measure plain autograd and move nothing: unset "
                     "OFFLOAD_ENABLED, or leave those rows out of --strategies")


def _resolve(args, parser) -> Settings:
    import torch

    from offload.bench.models import gpt_for_machine
    from offload.config import Config
    from offload.errors import ConfigError
    from offload.util.output_files import output_file_problem
    from offload.util.sizes import parse_size

    strategies = _parse_strategies(args.strategies, parser)
    if args.explain and "auto" not in strategies:
        strategies.append("auto")
    for name, value, low in (("--steps", args.steps, 1), ("--rounds", args.rounds, 1),
                             ("--batch", args.batch, 1), ("--seq", args.seq, 1),
                             ("--max-batch-cap", args.max_batch_cap, 1)):
        if value is not None and value < low:
            parser.error(f"{name} {value}: must be at least {low}")
    if not args.max_batch:   # else a mistyped run would start the whole default benchmark
        for name, value in (("--memory-limit", args.memory_limit),
                            ("--max-batch-cap", args.max_batch_cap),
                            ("--max-batch-time-s", args.max_batch_time_s)):
            if value is not None:
                parser.error(f"{name} applies to --max-batch only (add --max-batch)")
    if args.max_batch_time_s is not None and not args.max_batch_time_s > 0:
        parser.error(f"--max-batch-time-s {args.max_batch_time_s:g}: must be more than 0 "
                     "seconds")
    if args.warmup < 1:
        # A run's first step pays one-time costs (kernel choice, first touches of memory,
        # the runtime's arenas): the timings and the memory baseline begin after it.
        parser.error(f"--warmup {args.warmup}: must be at least 1 (the first step pays "
                     "one-time setup, which the timed steps and the memory baseline exclude)")
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s {args.timeout_s:g}: must be more than 0 seconds (a worker "
                     "is killed after it; the default is 1800)")
    device_text = args.device
    if device_text == "auto":
        device_text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_text)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: not a device (use cpu, cuda or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: torch sees no CUDA device "
                     "(torch.cuda.is_available() is False); use --device cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")

    memory_limit = None
    if args.memory_limit is not None:
        try:
            memory_limit = parse_size(args.memory_limit).nbytes
        except ValueError as exc:
            parser.error(f"--memory-limit {args.memory_limit!r}: {exc}")
        if not memory_limit:
            parser.error(f"--memory-limit {args.memory_limit!r}: must be more than 0 bytes")
    if args.max_batch and device.type == "cpu" and memory_limit is None:
        parser.error("--max-batch on CPU needs --memory-limit (e.g. --memory-limit 2GiB): RAM "
                     "is the device there, so the limit is checked against resident "
                     "activation bytes")

    if args.model and args.hf:
        parser.error("--model and --hf each name the model: give one")
    hf_model, preload = None, ()
    if args.model:
        if not args.input_shape:
            parser.error(f"--model {args.model!r} needs --input-shape (per-sample shape, "
                         "e.g. --input-shape 3,224,224)")
        if args.seq or args.gpt:
            parser.error("--seq and --gpt apply to the built-in GPT and --hf, not to --model")
        try:
            shape = tuple(int(x) for x in args.input_shape.split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            parser.error(f"--input-shape {args.input_shape!r}: expected positive integers "
                         "separated by commas, e.g. 3,224,224")
        if args.input_vocab is not None and args.input_vocab < 1:
            parser.error(f"--input-vocab {args.input_vocab}: the number of token ids, at least "
                         "1 (inputs are drawn from 0 to N-1)")
        from offload.bench.workload import load_factory

        try:
            load_factory(args.model)  # fail now, not in every worker
        except ValueError as exc:
            parser.error(str(exc))
        gpt, batch = None, args.batch or MODEL_DEFAULT_BATCH
        model_label, seq_len = args.model, None
    else:
        if args.input_shape or args.input_vocab is not None:
            parser.error(f"{'--input-shape' if args.input_shape else '--input-vocab'} applies "
                         "to --model only")
        base_cfg, machine_batch = gpt_for_machine(device)
        gpt = dataclasses.asdict(base_cfg)
        overrides = _parse_gpt(",".join(args.gpt), parser)
        gpt.update(overrides)
        if args.seq:
            gpt["seq_len"] = args.seq
        try:
            type(base_cfg)(**gpt)
        except ValueError as exc:
            parser.error(f"--gpt: {exc}")
        batch = args.batch or (machine_batch if device.type == "cuda" else CPU_DEFAULT_BATCH)
        seq_len = gpt["seq_len"]
        model_label = (f"GPT h{gpt['hidden']} L{gpt['layers']} heads{gpt['heads']} "
                       f"vocab{gpt['vocab_size']}")
        if args.hf:
            from offload.bench import hf

            if "dropout" in overrides:
                parser.error("--gpt dropout: a --hf model's dropout is its config's (write a "
                             "config.json to change it)")
            try:
                hf_model = hf.resolve(args.hf, gpt, args.seq)
            except ValueError as exc:
                parser.error(str(exc))
            if overrides and os.path.exists(args.hf):
                parser.error(f"--gpt sizes a --hf model type, not the config.json {args.hf!r} "
                             "(edit the file instead)")
            gpt, seq_len, model_label = None, hf_model.seq_len, hf_model.label
            # Workers import transformers from the forkserver; the modeling module each
            # imports itself (its imports print other packages' warnings to its log).
            preload = ("transformers",)

    if args.budget is not None:
        if "auto" not in strategies:   # else it was silently measured by no row
            parser.error(f"--budget applies to the auto row only (add auto to --strategies: "
                         f"--strategies {','.join([*strategies, 'auto'])})")
        try:  # the runtime's own rules for OFFLOAD_BUDGET (a share is at most 100%)
            Config.from_env(env={}, budget=args.budget)
        except ConfigError as exc:
            parser.error(f"--budget {args.budget!r}: "
                         + str(exc).removeprefix(f"budget={args.budget!r}: "))
    # Written after the run: a path that cannot be written fails now, not after it.
    for opt, path, example in (("--json", args.json, "rows.json"),
                               ("--plot", args.plot, "plot.png")):
        problem = path is not None and output_file_problem(path, example)
        if problem:
            parser.error(f"{opt} {path!r}: {problem}")
    if args.plot:
        problem = report.plot_unavailable_reason() or report.plot_format_problem(args.plot)
        if problem:
            parser.error(problem if problem.startswith("--plot") else
                         f"--plot {args.plot!r}: {problem}")

    nvme_bases = _nvme_bases(args.nvme_dir, parser)
    _check_runtime_settings(strategies, device, nvme_bases, args.budget, parser)
    spec = RunSpec(strategy="none", device=str(device), dtype=dtype, batch=batch,
                   warmup=args.warmup, steps=args.steps, seed=args.seed, gpt=gpt,
                   model=args.model, input_shape=shape if args.model else None,
                   input_vocab=args.input_vocab,
                   hf=hf_model.to_dict() if hf_model else None,
                   budget=args.budget, explain=args.explain, plugins=tuple(args.plugin))
    if args.max_batch_cap is not None and args.max_batch_cap < batch:
        # The search starts from the main run's batch: a lower cap is never what it tries.
        parser.error(f"--max-batch-cap {args.max_batch_cap}: below the batch of the main run "
                     f"({batch}); the search starts there (lower --batch to search below it)")
    return Settings(
        strategies=strategies, spec=spec, rounds=args.rounds,
        nvme_bases=nvme_bases, model_label=model_label,
        seq_len=seq_len, json_path=args.json, plot_path=args.plot, explain=args.explain,
        max_batch=args.max_batch, memory_limit_bytes=memory_limit,
        max_batch_cap=args.max_batch_cap or 8 * batch,
        max_batch_time_s=args.max_batch_time_s or 180.0,
        timeout_s=args.timeout_s, preload=preload)


def _meta(s: Settings) -> Meta:
    return Meta(device=s.spec.device, dtype=s.spec.dtype, model=s.model_label,
                batch=s.spec.batch, seq_len=s.seq_len, warmup=s.spec.warmup,
                steps=s.spec.steps, rounds=s.rounds, memory_limit_bytes=s.memory_limit_bytes)


def benchmark(s: Settings, progress: Progress) -> list[Row]:
    """Run every strategy (and --max-batch), return the rows in --strategies order."""
    import torch

    device = torch.device(s.spec.device)
    results: dict[str, list[RunResult]] = {n: [] for n in s.strategies}
    with Workspace(s.nvme_bases) as ws:
        skip: dict[str, RunResult] = {}
        for name in s.strategies:
            try:
                reason = strategies_mod.get(name).unavailable_reason(device, ws.nvme_dir)
            except Exception as exc:  # a broken runtime install must not stop the others
                reason, failed = f"failed: {type(exc).__name__}: {exc}", True
            else:
                failed = False
            if reason:
                skip[name] = RunResult(strategy=name, batch=s.spec.batch, reason=reason,
                                       error=failed)
        runner = WorkerRunner(ws, s.timeout_s, s.preload)
        checker = GradChecker()
        runs = [(r, n) for r, n in schedule(s.strategies, s.rounds) if n not in skip]
        task = progress.add_task("starting", total=len(runs))
        try:
            try:
                for r, name in runs:
                    progress.update(task, description=f"{name} (round {r + 1}/{s.rounds})")
                    result = runner.run(s.spec.replace(strategy=name), save_grads=True)
                    checker.add(name, result.grads_path, result.grad_hashes)
                    results[name].append(result)
                    progress.console.print(_run_line(name, r, s.rounds, result),
                                           highlight=False, markup=False)
                    progress.advance(task)
            except KeyboardInterrupt:
                if not any(results.values()):
                    raise
            # Interrupted (None: not): the runs that finished still make a table.
            done = sum(map(len, results.values()))
            interrupted = f"after {done} of {len(runs)} runs" if done < len(runs) else None
            rows = []
            for name in s.strategies:
                res = results[name] or [skip.get(name) or RunResult(
                    strategy=name, batch=s.spec.batch, reason="interrupted before it ran")]
                row = rows_mod.make_row(name, strategies_mod.get(name).description, _meta(s),
                                        res, checker.summary(name))
                if interrupted:   # the rounds it ran (none: interrupted before it ran)
                    row.rounds = len(results[name])
                rows.append(row)
            if s.max_batch and interrupted is None:
                try:
                    _max_batch(s, rows, results, runner, progress, device.type)
                except KeyboardInterrupt:   # the rows keep what the search had found
                    interrupted = "during --max-batch (every run had finished)"
        finally:
            checker.close()
    rows_mod.add_relative(rows)
    if interrupted is not None:
        raise Interrupted(rows, interrupted)
    return rows


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) after some runs finished: `rows` holds what they measured."""

    def __init__(self, rows: list[Row], when: str):
        super().__init__(f"interrupted {when}")
        self.rows = rows


def _run_line(name: str, r: int, rounds: int, result: RunResult) -> str:
    head = f"  {name:<16} round {r + 1}/{rounds}: "
    if not result.available:
        return head + ("" if result.error else "not available: ") + str(result.reason)
    return head + f"{result.median_step_s:.2f} s/step ({result.wall_s:.0f} s in the worker)"


def _max_batch(s, rows, results, runner, progress, device_type) -> None:
    for row in rows:
        name = row.strategy
        if not row.available:
            continue
        base = results[name][0]
        task = progress.add_task(f"max batch {name}", total=None)

        def probe(batch: int, name=name) -> RunResult:
            spec = s.spec.replace(strategy=name, batch=batch, warmup=min(1, s.spec.warmup),
                                  steps=1, explain=False)
            return runner.run(spec)

        def on_probe(batch: int, ok, name=name, task=task) -> None:
            if ok is None:
                progress.update(task, description=f"max batch {name}: trying batch {batch}")
            else:
                progress.console.print(f"  max batch {name}: batch {batch} "
                                       f"{'fits' if ok else 'does not fit'}", highlight=False)

        found = maxbatch.search(base, probe, device_type=device_type,
                                limit_bytes=s.memory_limit_bytes, cap=s.max_batch_cap,
                                time_budget_s=s.max_batch_time_s, on_probe=on_probe)
        progress.remove_task(task)
        for f in dataclasses.fields(found):
            setattr(row, f.name, getattr(found, f.name))


def _progress(console: Console) -> Progress:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    # Without a terminal a live bar cannot redraw (and rich holds back prints meanwhile):
    # then only the one-line-per-run messages go to stderr, as they happen.
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    disable=not console.is_terminal)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (0 ok, 1 a strategy failed or nothing was
    measured, 2 usage, 130 ^C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from rich.console import Console
    except ImportError:
        print("offload-bench: the table needs the 'rich' package, which is not installed: "
              "pip install 'offload[bench]' (or pip install rich)", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(strategies_mod.plugins(args.plugin))
        except ValueError as exc:
            parser.error(str(exc))
        return _main(args, parser, Console)


def _main(args, parser, Console) -> int:
    """main() with the --plugin strategies registered."""
    from offload._build_info import build_info, summary as build_summary

    settings = _resolve(args, parser)
    err = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=200)
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = _is_main_thread()
    if in_main_thread:
        # SIGTERM unwinds like Ctrl-C, so the workspace is removed (runner Rule 1).
        signal.signal(signal.SIGTERM, _raise_interrupt)
    started = datetime.datetime.now()
    interrupted: Interrupted | None = None
    try:
        with _progress(err) as progress:
            rows = benchmark(settings, progress)
    except Interrupted as exc:
        interrupted, rows = exc, exc.rows
    except KeyboardInterrupt:
        err.print("offload-bench: interrupted; temporary files removed")
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    elapsed_s = (datetime.datetime.now() - started).total_seconds()
    # Asked here, after every worker has finished: it initializes CUDA in this process, and
    # a context held by the parent while workers run would take GPU memory from them.
    info = build_info()
    for row in rows:
        row.build = info
    out.print(build_summary(info), highlight=False, markup=False)
    report.print_table(rows, out)
    out.print(f"  {started:%Y-%m-%d %H:%M}, {platform.node() or 'this machine'}, "
              f"torch {__import__('torch').__version__}, {elapsed_s:.0f} s in all",
              highlight=False)
    if settings.explain:
        out.print(report.explain_text(rows), highlight=False, markup=False)
    failed_write = False
    if settings.json_path:
        try:
            report.write_json(rows, settings.json_path)
            err.print(f"wrote {settings.json_path}")
        except OSError as exc:   # checked at the start; the disk or the path changed since
            failed_write = True
            kept = report.write_json_anywhere(rows)
            err.print(f"offload-bench: could not write --json {settings.json_path} ({exc}); "
                      + (f"the rows are in {kept}" if kept else "the table above holds them"),
                      highlight=False, markup=False, soft_wrap=True)
    if settings.plot_path:
        try:
            report.write_plot(rows, settings.plot_path)
            err.print(f"wrote {settings.plot_path}")
        except OSError as exc:
            failed_write = True
            err.print(f"offload-bench: could not write --plot {settings.plot_path} ({exc})",
                      highlight=False, markup=False, soft_wrap=True)
    if interrupted is not None:
        err.print(f"offload-bench: {interrupted}; the table holds the finished runs (a row's "
                  f"rounds say how many); temporary files removed")
        return 130
    if rows and not any(r.available for r in rows):   # every row says why above
        err.print(f"offload-bench: nothing was measured ({_why_nothing(rows)}; the reasons "
                  "are in the table)", highlight=False, markup=False, soft_wrap=True)
        return 1
    return 1 if failed_write or any(r.error for r in rows) else 0


def _why_nothing(rows: list) -> str:
    """What kept the rows from being measured, with what to do about each kind."""
    said = [r.reason or "" for r in rows]
    timed_out = sum(TIMED_OUT in reason for reason in said)
    oom = sum(reason.startswith(OUT_OF_MEMORY) or KILLED_OOM in reason for reason in said)
    other = len(rows) - timed_out - oom
    runs = lambda n: f"{n} run{'s' * (n != 1)}"  # noqa: E731
    parts = []
    if oom:
        parts.append(f"{runs(oom)} ran out of memory: a smaller --batch, --seq or model fits "
                     "more")
    if timed_out:
        parts.append(f"{runs(timed_out)} timed out: raise --timeout-s")
    if other:
        parts.append(f"{runs(other)} failed or not available here")
    return "; ".join(parts)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
