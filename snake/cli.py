"""The `snake` command: `snake train` (an embedded default run), `snake plan`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from snake.cli_args import (
    HOLDOUT,
    _check_checkpoint_dir,
    _check_export_dir,
    _check_train_args,
    _checkpoint_step,
    _output_dir,
    _remove_if_empty,
    _snake_config,
    _train_parser,
)
from snake.cli_signals import (
    _STOP_SIGNALS,
    _interrupt_setup,
    _Interrupted,
    _Signals,
    _signals_cancel_this_task,
    _StoppedBySignal,
)
from snake.clip import json_float
from snake.config import (
    SnakeConfig,
)
from snake.errors import ActorFailed, DataError, SnakeError
from snake.lr import describe
from snake.offload_dir import scratch_parent

if TYPE_CHECKING:
    from snake.trace import Tracer
    from snake.train_source import Subject
    from snake.trainer import SnakeTrainer


async def _train(args: argparse.Namespace, subject: Subject, config: SnakeConfig, resumed: dict | None) -> int:
    """The run; _Interrupted when SIGINT or SIGTERM stopped it. `resumed`: the --resume
    checkpoint and its step, for report.json."""
    steps: list[dict] = []
    with _signals_cancel_this_task() as signals:
        caught = signals.caught
        try:
            return await _train_run(args, subject, config, steps, resumed, signals)
        except _StoppedBySignal:
            pass
        except asyncio.CancelledError:
            if not caught:
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # the cancellation was ours and ends here
        held = _checkpoint_step(args.checkpoint) if args.checkpoint else None
        raise _Interrupted(caught[0], len(steps), (args.checkpoint, held) if held is not None else None) from None


def _config_json(value: Any) -> Any:
    """`asdict(config)` as JSON values: tuples as lists, paths as strings."""
    if isinstance(value, dict):
        return {k: _config_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_config_json(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _config_dict(config: SnakeConfig) -> dict[str, Any]:
    """The config as JSON values, its optimizer's callables named (`snake.lr.describe`)."""
    out = _config_json(asdict(config))
    out["optimizer"]["lr_schedule"] = describe(config.optimizer.lr_schedule)
    out["optimizer"]["no_decay"] = describe(config.optimizer.no_decay)
    out["optimizer"]["max_grad_norm"] = json_float(config.optimizer.max_grad_norm)
    return out


async def _train_run(args: argparse.Namespace, subject: Subject, config: SnakeConfig, steps: list[dict],
                     resumed: dict | None, signals: _Signals) -> int:
    """Train, appending each step's numbers to `steps`, and write the run's files."""
    from snake.corpus import holdout_windows, random_windows
    from snake.timeline import plot_timeline
    from snake.train_source import train_record
    from snake.trainer import SnakeTrainer

    corpus = subject.corpus
    torch.manual_seed(args.seed)  # the model's fresh weights (a LoRA's adapters) draw from it
    assert subject.build is not None
    model = subject.build()
    params = sum(p.numel() for p in model.parameters())
    learned = sum(p.numel() for p in model.parameters() if p.requires_grad)
    count = f"{_millions(params)} parameters" + (f", {_millions(learned)} trained" if learned < params else "")
    print("model:", json.dumps(subject.record), f"({count})")
    print("config:", json.dumps(_config_dict(config)))
    data = random_windows(corpus, batch=args.batch, seq=args.seq, seed=args.seed, holdout=HOLDOUT)
    held = (holdout_windows(corpus, batch=args.batch, seq=args.seq, batches=args.eval_batches, holdout=HOLDOUT)
            if args.eval_batches else [])
    val: dict[str, float] = {}
    out = Path(args.out)
    async with SnakeTrainer(model, data=data, config=config) as trainer:
        try:
            wall, trained = await _train_steps(trainer, args, config, held, val, steps, train_record(args, subject),
                                               signals)
        except BaseException as exc:  # failed or interrupted: its trace tells what it was doing
            _save_trace_of_stopped_run(trainer.trace, out, steps, exc)
            raise
        trainer.trace.save(out / "trace.json")
        spans = list(trainer.trace.spans)
        # the timeline's window: the last steps, not the evaluation after them
        plot_timeline([s for s in spans if s.start_s < trained], out / "timeline.png", window_s=_window(steps),
                      dropped=trainer.trace.recorded - len(spans))
        report_json = {
            "model": subject.record,
            "text": subject.text,  # what a --resume of its checkpoint must train on (snake.train_source)
            "resumed_from": resumed,  # the --resume checkpoint and its step, or null
            "config": _config_dict(trainer.config),  # what --plan picked too
            "steps": steps,
            "wall_seconds": wall,  # of the runs, their setup included
            "tokens_per_s": sum(s["tokens"] for s in steps) / wall,
            "data_wait_s": sum(s["data_wait_s"] for s in steps),  # steps waiting for their batch
            "traffic_last_step": {"/".join(k): v for k, v in trainer.traffic().items()},
            "trace_summary": trainer.trace.summary(),
            # on --eval-batches batches of the held-out text, before and after training
            "val_loss": {k: json_float(v) for k, v in val.items()},
        }
        (out / "report.json").write_text(json.dumps(report_json, indent=2, allow_nan=False))
        if args.checkpoint:
            await _save(trainer, args.checkpoint, train_record(args, subject))
            print(f"checkpoint: {args.checkpoint} (snake export {args.checkpoint} "
                  f"{'--peft' if subject.peft else '--hf'} DIR)")
    held_out = f"; held-out loss {val['before']:.4f} -> {val['after']:.4f}" if val else ""
    print(f"loss {float(steps[0]['loss']):.4f} -> {float(steps[-1]['loss']):.4f} in {wall:.1f} s{held_out}; "
          f"wrote trace.json, report.json, timeline.png to {out}")
    return 0


def _millions(n: int) -> str:
    """A parameter count in millions, with the digits a small one needs (a LoRA's 8 K: 0.008 M)."""
    return f"{n / 1e6:.2f} M" if n >= 10**5 or n == 0 else f"{n / 1e6:.2g} M"


async def _save(trainer: SnakeTrainer, directory: str, record: dict[str, Any]) -> None:
    """trainer.save, then the run's text and windows beside the checkpoint (`record`, what a
    --resume of it checks: snake.train_source.TRAIN_RECORD)."""
    from snake.train_source import write_train_record

    await trainer.save(directory)
    await asyncio.to_thread(write_train_record, directory, record)


async def _train_steps(
    trainer: SnakeTrainer, args: argparse.Namespace, config: SnakeConfig, held: list, val: dict[str, float],
    steps: list[dict], record: dict[str, Any], signals: _Signals,
) -> tuple[float, float]:
    """The trainer's work in `snake train`: resume, evaluate, train --steps steps (with the
    progress bar, a checkpoint every --save-every), evaluate. Returns the runs' wall seconds
    and the trace's clock at the end of training (before the evaluation after it). `record`:
    what each checkpoint's TRAIN_RECORD says. A signal while a run trains (once it is set
    up) stops it after the steps in flight: what they trained goes to --checkpoint, and
    _StoppedBySignal is raised."""
    if args.resume:  # its step, weights, optimizer state, RNG and place in the data
        await trainer.load(args.resume)
    if held:
        val["before"] = (await trainer.evaluate(held)).loss
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    links: dict[str, str] = {}
    skipped = [0]  # steps a dynamic loss scale skipped (an overflow)

    def on_step(s) -> None:  # type: ignore[no-untyped-def]
        # a step's seconds: its wall time, the wait for its batch (data_wait_s) included
        steps.append({"step": s.step, "loss": json_float(s.loss), "seconds": s.seconds,
                      "data_wait_s": s.data_wait_s, "tokens": s.tokens, "lr": s.lr,
                      "grad_norm": json_float(s.grad_norm), "loss_scale": json_float(s.loss_scale),
                      "skipped": s.skipped})
        if len(steps) % 10 == 1:  # bandwidth per tier link, from the trace
            for link, v in trainer.trace.summary()["links"].items():
                links[link] = f"{v['avg_bytes_per_s'] / 2**20:.0f}MiB/s"
        info = {"loss": f"{s.loss:.4f}", "tok/s": f"{s.tokens / s.seconds:.0f}", **links}
        if s.data_wait_s > 0.05 * s.seconds:  # input-bound: the step waited for its batch
            info["data wait"] = f"{s.data_wait_s / s.seconds:.0%}"
        if config.optimizer.lr_schedule is not None:
            info["lr"] = f"{s.lr:.2e}"
        if s.grad_norm is not None:
            info["gnorm"] = f"{s.grad_norm:.3f}"
        if s.loss_scale is not None:
            info["scale"] = f"{s.loss_scale:g}"
            skipped[0] += s.skipped
            if skipped[0]:
                info["skipped"] = str(skipped[0])
        bar.set_postfix(info, refresh=False)
        bar.update(1)

    wall, done = 0.0, 0
    try:
        while done < args.steps:  # in pieces of --save-every steps, a checkpoint after each but the last
            n = min(args.save_every or args.steps, args.steps - done)
            t0 = time.perf_counter()
            signals.graceful = lambda: trainer.engine is not None and trainer.stop()
            try:
                report = await trainer.run(n, on_step=on_step)
            except DataError as e:
                if e.report is not None and args.checkpoint:  # stopped cleanly: what it trained is kept
                    await _save(trainer, args.checkpoint, record)
                    print(f"\nsnake train: the data stopped the run after {done + len(e.report.steps)} steps; saved "
                          f"them to {args.checkpoint}", file=sys.stderr)
                raise
            finally:
                signals.graceful = None  # a signal while it saves or evaluates cancels that
            wall += time.perf_counter() - t0
            done += len(report.steps)
            if report.stopped or signals.caught:
                if args.checkpoint:  # what the steps in flight trained is kept
                    await _save(trainer, args.checkpoint, record)
                raise _StoppedBySignal()
            if done < args.steps:
                await _save(trainer, args.checkpoint, record)
    finally:
        bar.close()
    trained = trainer.trace.now()
    if held:
        val["after"] = (await trainer.evaluate(held)).loss
    return wall, trained


def _save_trace_of_stopped_run(trace: Tracer, out: Path, steps: list[dict], exc: BaseException) -> None:
    """Write trace.json and timeline.png of a run that failed or was interrupted, and say so
    on stderr. A failure here is said in one line; the caller re-raises the run's error."""
    from snake.timeline import plot_timeline

    how = "interrupted" if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | _StoppedBySignal) else "failed"
    spans = list(trace.spans)
    if not spans:
        return  # it stopped before anything was traced
    wrote = []
    try:
        trace.save(out / "trace.json")
        wrote.append("trace.json")
        plot_timeline(spans, out / "timeline.png", window_s=_window(steps), dropped=trace.recorded - len(spans))
        wrote.append("timeline.png")
    except Exception as e:  # said, not raised: the run's own error is the one to raise
        print(f"snake train: could not save the {how} run's {'timeline.png' if wrote else 'trace.json'} to "
              f"{out}: {type(e).__name__}: {e}", file=sys.stderr)
    if wrote:
        print(f"snake train: the run {'was interrupted' if how == 'interrupted' else how} after {len(steps)} "
              f"steps; wrote its {' and '.join(wrote)} to {out}", file=sys.stderr)


def _window(steps: list[dict]) -> float | None:
    """Show about the last three steps in the timeline, where it is readable."""
    if len(steps) < 4:
        return None
    return sum(s["seconds"] for s in steps[-3:]) * 1.1


def _seconds(text: str) -> float:
    """A positive number of seconds (--last)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


def _image_path(out: str) -> str | None:
    """Why `out` cannot take the timeline PNG (None: it can)."""
    path = Path(out).expanduser()
    if path.suffix.lower() != ".png":
        return "must name a .png file"
    if path.is_dir():
        return "is a directory; name a .png file in it"
    if not path.parent.is_dir():
        return f"is in {path.parent}, which is not a directory; create it first"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"is in {path.parent}, which is not writable"
    return None


def _trace(argv: list[str]) -> int:
    from snake.timeline import plot_timeline
    from snake.trace import load_trace, summarize

    p = argparse.ArgumentParser(prog="snake trace")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("summarize", help="per-actor utilization and per-link bandwidth")
    s.add_argument("trace")
    s.add_argument("--json", action="store_true")
    pl = sub.add_parser("plot", help="per-actor timeline (Gantt chart) as PNG")
    pl.add_argument("trace")
    pl.add_argument("-o", "--out", default="timeline.png")
    pl.add_argument("--last", type=_seconds, default=None, help="only the last SECONDS of the trace")
    args = p.parse_args(argv)
    if args.what == "plot":  # `-o=~/t.png`: a shell leaves the ~ as it is
        args.out = str(Path(args.out).expanduser())
    if args.what == "plot" and (why := _image_path(args.out)) is not None:
        print(f"snake trace: -o {args.out!r} {why}", file=sys.stderr)
        return 2
    try:
        spans, records = load_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"snake trace: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    try:
        if args.what == "plot":
            if not spans:
                print(f"snake trace: {args.trace} has no spans to plot", file=sys.stderr)
                return 2
            totals = records.get("totals") or {}
            dropped = int(totals.get("spans_recorded", 0)) - int(totals.get("spans_kept", 0))
            plot_timeline(spans, args.out, window_s=args.last, dropped=dropped)
            print(f"wrote {args.out}")
            return 0
        _print_summary(summarize(spans, **records), as_json=args.json)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at exit
    except BrokenPipeError:  # `snake trace summarize t.json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_summary(summary: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    print(f"traced wall time: {summary['wall_s']:.3f} s")
    spans = summary.get("spans", {})
    if spans.get("dropped"):
        print(f"spans: {spans['recorded']} recorded, the newest {spans['kept']} kept in the file "
              "(the numbers below cover all of them)")
    print(f"{'actor':<16}{'busy s':>10}{'busy %':>9}")
    for actor, v in summary["actors"].items():
        print(f"{actor:<16}{v['busy_s']:>10.3f}{100 * v['busy_fraction']:>8.1f}%")
    loop = summary.get("event_loop")
    if loop is not None:
        print(f"event loop CPU: {loop['cpu_s']:.3f} s in {loop['run_wall_s']:.3f} s of run() "
              f"({100 * loop['cpu_fraction']:.1f}% of one core)")
    if "threads" in summary:
        print(f"{'threads (over run())':<24}{'CPU s':>9}{'cores':>7}{'run-queue wait':>16}")
        for group, v in summary["threads"].items():
            print(f"{group:<24}{v['cpu_s']:>9.3f}{v['cpu_fraction']:>7.2f}{100 * v['runqueue_fraction']:>15.1f}%")
    print(f"{'link':<12}{'MiB moved':>10}{'MiB copied':>12}{'MiB/s copying':>15}{'MiB/s avg':>11}")
    for link, v in summary["links"].items():
        print(
            f"{link:<12}{v['bytes'] / 2**20:>10.1f}{v.get('copied_bytes', v['bytes']) / 2**20:>12.1f}"
            f"{v['busy_bytes_per_s'] / 2**20:>15.1f}{v['avg_bytes_per_s'] / 2**20:>11.1f}"
        )
    print("(moved: what the schedule sends over the link; copied: what took a copy, which a CPU "
          "device skips for data already in CPU memory)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("snake")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="snake", description="train LLMs bigger than GPU memory")
    parser.add_argument("--version", action="version", version=f"snake {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _train_parser(sub)
    sub.add_parser("plan", help="profile this machine and plan placement, alpha and micro-batches", add_help=False)
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face model (from_pretrained), or a PEFT "
                                       "model's checkpoint as its adapters (PeftModel.from_pretrained)")
    ex.add_argument("checkpoint")
    to = ex.add_mutually_exclusive_group(required=True)
    to.add_argument("--hf", metavar="DIR", help="output directory of the whole model")
    to.add_argument("--peft", metavar="DIR", help="output directory of a PEFT model's adapters (adapter_config.json "
                                                  "and adapter_model.safetensors)")
    sub.add_parser("trace", help="summarize or plot a trace.json", add_help=False)
    if argv and argv[0] == "trace":
        return _trace(argv[1:])
    if argv and argv[0] == "plan":
        from planner.cli import plan_main

        return plan_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "export":
        from snake.export import export_checkpoint_hf, export_checkpoint_peft

        try:
            if args.peft is not None:
                _check_export_dir(args.peft, "--peft", "adapter_config.json", args.checkpoint)  # before it is read
                out = export_checkpoint_peft(Path(args.checkpoint).expanduser(), Path(args.peft).expanduser())
            else:
                _check_export_dir(args.hf, "--hf", "config.json", args.checkpoint)
                out = export_checkpoint_hf(Path(args.checkpoint).expanduser(), Path(args.hf).expanduser())
        except SnakeError as e:
            print(f"snake export: {e}", file=sys.stderr)
            return 2
        how = "peft's PeftModel.from_pretrained(base_model, DIR)" if args.peft is not None else \
            "transformers' from_pretrained"
        print(f"wrote {out} (load it with {how})")
        return 0
    if args.cmd == "train":
        try:
            return _train_main(args)
        except SnakeError as e:
            if isinstance(e, ActorFailed | DataError) and e.__cause__ is not None \
                    and not isinstance(e.__cause__, SnakeError):
                raise  # an actor or the data hit a bug, not a bad argument: the traceback is what a report needs
            print(f"snake train: {e}", file=sys.stderr)
            return 2
    return 2


def _train_main(args: argparse.Namespace) -> int:
    # until the event loop takes SIGINT and SIGTERM over (_signals_cancel_this_task), they
    # raise here, so a temporary offload directory made meanwhile is removed on the way out
    before = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    try:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, _interrupt_setup)
    except ValueError:  # off the main thread: the signals keep their handlers
        before = {}
    try:
        return _train_setup_and_run(args)
    except _Interrupted as e:  # the temporary offload directory is gone by now; a given one stays
        print(f"snake train: {e}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)


def _train_setup_and_run(args: argparse.Namespace) -> int:
    from snake.train_source import (
        check_resume,
        check_resume_options,
        resume_defaults,
        resume_manifest,
        subject,
    )

    trains = subject(args)
    manifest = resume_manifest(args.resume) if args.resume else None
    if manifest is not None:
        resume_defaults(args, manifest)
        check_resume_options(args, manifest)
    chosen = _check_train_args(args, trains)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run  # type: ignore[assignment]
    with contextlib.ExitStack() as stack:
        offload_dir = args.offload_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="snake-offload-", dir=scratch_parent()))
        config = _snake_config(args, offload_dir)
        # the run writes these at its end: refuse a bad path now, not after training
        if args.checkpoint:
            _check_checkpoint_dir(args.checkpoint, str(offload_dir), args.out)
        if manifest is not None and (note := check_resume(args, chosen, config, manifest)) is not None:
            print(f"snake train: {note}", file=sys.stderr)
        made = _output_dir("--out", args.out)
        resumed = None if manifest is None else {"checkpoint": args.resume, "step": manifest["step"]}
        try:
            return runner(_train(args, chosen, config, resumed))
        finally:  # refused before it wrote anything (a bad offload_dir, found by the trainer): none left
            _remove_if_empty(made)


if __name__ == "__main__":
    sys.exit(main())
