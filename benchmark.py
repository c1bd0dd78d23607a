"""Runs the whole comparison, one fresh process per experiment, then writes results/REPORT.md.

    python benchmark.py --preset smoke            # every script, tiny settings: minutes on a 2-core CPU
    python benchmark.py --preset throughput       # ResNet50/224 speed and memory, fixed steps per script
    python benchmark.py --preset seed             # the articles' experiment for every script (hours)
    python benchmark.py --preset smoke --only pytorch_DDP.py,pytorch_FSDP.py --force
    python benchmark.py --preset throughput --repeats 5   # each run launched 5 times, interleaved: medians and CIs
    python benchmark.py compare BASE.csv NEW.csv  # the regression gate: exit 1 when a run got slower beyond noise
    python benchmark.py --preset smoke --world-sizes 1,2,4,8 --scaling weak   # scaling curves per strategy
    python benchmark.py report --readme           # rewrite the report (--readme: also the README's tables) from the CSV
    python benchmark.py doctor                    # what a bug report needs, then the smoke preset, checked
    python benchmark.py advise --gpus 4 --gpu-memory-gib 24   # predicted memory per strategy, and which to use
    python benchmark.py calibrate --preset time   # the step model's inputs on this machine (docs/time.md)
    python benchmark.py predict --results R.csv   # measured rows predicted again by this checkout's step model

The matrix lives in config/benchmark.yaml, the scripts and their launchers in common/registry.py.
Each run gets the launcher it needs (python, torchrun, deepspeed, accelerate launch) and one
process per GPU, or 2 gloo processes on a CPU-only machine. A run that fails, runs out of memory,
diverges or passes its time limit becomes a row with that status and the matrix goes on. Runs
already in the CSV (same run name, same device, same launch index, status ok or skipped) are not run
again unless --force: an interrupted matrix, run again, launches only what is missing.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import yaml

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from common.config import OneLineParser, UsageError  # noqa: E402


def add_matrix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smoke",
                   help="a preset of the matrix file: smoke, seed, throughput, time or large in config/benchmark.yaml")
    p.add_argument("--only", default=None, help="comma-separated scripts or run names of the preset")
    p.add_argument("--matrix", default=os.path.join(ROOT, "config", "benchmark.yaml"), help="matrix file")
    p.add_argument("--log-dir", default="results/logs", help="one log file per run")
    p.add_argument("--force", action="store_true", help="rerun runs already in the CSV")
    p.add_argument("--world-sizes", default=None, help="comma-separated process counts, e.g. 1,2,4,8: every "
                   "distributed run of the preset once per count (capped at the machine's GPUs; 1 and 2 on CPU)")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="with --world-sizes: strong keeps the global batch; weak keeps the per-rank batch "
                        "(the preset's batch_size and train_samples are per rank, multiplied by the world size)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default="results/summary.csv", help="CSV the runs append to")
    p.add_argument("--report", default="results/REPORT.md", help="Markdown report (charts beside it)")


def _check_run_flags(opts) -> None:
    """Flags that would otherwise be ignored or mean their opposite, refused before any run."""
    if os.path.isdir(opts.report):  # written after every run
        raise UsageError(f"--report {opts.report}: a folder; give the Markdown file's path")
    for flag in ("only", "world_sizes"):  # an empty list is a mistake, not "everything"
        value = getattr(opts, flag, "")
        if value is not None and not value.replace(",", "").strip():
            raise UsageError(f"--{flag.replace('_', '-')} {value!r}: names no run")
    if opts.scaling == "weak" and not opts.world_sizes:
        raise UsageError("--scaling weak applies to a --world-sizes sweep: give --world-sizes too")
    slurm = [f"--{k.replace('_', '-')}" for k, off in (("nodes", 1), ("gpus_per_node", 0), ("partition", ""),
                                                       ("account", ""), ("time", ""), ("sbatch_arg", []))
             if getattr(opts, k, off) != off]
    if slurm and opts.launcher != "slurm":
        raise UsageError(f"{', '.join(slurm)}: Slurm's flags; add --launcher slurm (or drop them)")


def cmd_run(opts) -> int:
    _check_run_flags(opts)
    if opts.launcher == "slurm":  # one sbatch job per run
        from common.bench.slurm import run_slurm as run_matrix
    else:
        from common.bench.matrix import run_matrix

    run_matrix(opts)
    if not opts.dry_run:
        cmd_report(opts)
    return 0


def cmd_report(opts) -> int:
    from common.report import update_readme, write_report

    reference = os.path.join(ROOT, "results", "reference.csv")
    if not os.path.isfile(opts.results):  # never an existing report rewritten as "No runs yet" from a typo
        raise UsageError(f"results file not found: {opts.results} (run a preset first, or name the CSV)")
    if getattr(opts, "readme", None) and not os.path.isdir(opts.campaigns):  # its table would be emptied
        raise UsageError(f"--campaigns {opts.campaigns}: no such folder (the campaign folders the README's table "
                         "is filled from)")
    path = write_report(opts.results, opts.report, reference)
    print(f"report: {os.path.relpath(path, ROOT)}")
    if getattr(opts, "readme", None):
        done = update_readme(opts.readme, opts.campaigns, reference)
        print(f"README tables: {os.path.relpath(done, ROOT)} (results from {os.path.relpath(opts.campaigns, ROOT)})")
    return 0


def cmd_doctor(opts) -> int:
    from common.bench.doctor import doctor

    status = doctor(opts)
    cmd_report(opts)  # what --report promises: the doctor's runs as a report, with its charts
    return status


def cmd_advise(opts) -> int:
    from common.bench.advise import advise

    return advise(opts)


def _calibrate_args(p):
    from common.bench.calibrate import add_args

    add_args(p)


def cmd_calibrate(opts) -> int:
    from common.bench.calibrate import calibrate

    return calibrate(opts)


def _predict_args(p):
    from common.bench.predict import add_args

    add_args(p)


def cmd_predict(opts) -> int:
    from common.bench.predict import predict

    return predict(opts)


def _advise_args(p):
    from common.bench.advise import add_args

    add_args(p)


def _run_args(p):
    add_matrix_args(p)
    add_output_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the commands only (slurm: write the job files only)")
    p.add_argument("--save-dir", default="", help="checkpoint folder of every run (<save-dir>/<script>/model_final.pt, "
                   "resume/); default: the preset's save_dir, else the scripts' own (checkpoints)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: one process group per run on this machine; slurm: one sbatch job per run")
    slurm = p.add_argument_group("--launcher slurm")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes per distributed run")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs (processes) per node; 0: one CPU process")
    slurm.add_argument("--partition", default="", help="sbatch --partition")
    slurm.add_argument("--account", default="", help="sbatch --account")
    slurm.add_argument("--time", default="", help="sbatch --time (HH:MM:SS); default the preset's timeout_s")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="any other sbatch option, e.g. --sbatch-arg=--qos=high (repeatable)")
    p.add_argument("--repeats", type=int, default=1,
                   help="launch every run N times as fresh processes, round by round across the runs; "
                        "the report gives medians, spread and confidence intervals")
    p.add_argument("--relaunch-busy", type=int, default=0, metavar="N",
                   help="launch a run again, up to N times, when its timed window found the host busy with other "
                        "work or the hypervisor (10%% or more of its CPU time: host_other_pct + host_steal_pct); "
                        "the report reads the newest launch and lists the ones launched again")


def _compare_args(p):
    p.add_argument("base", help="results CSV of the reference (e.g. the main branch)")
    p.add_argument("new", help="results CSV of the candidate")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="exit 1 when a run is slower than base by more than this fraction, beyond noise")


def cmd_compare(opts) -> int:
    from common.bench.compare import compare

    return compare(opts.base, opts.new, opts.threshold)


def _doctor_args(p):
    add_matrix_args(p)
    p.set_defaults(preset="smoke", force=True)
    p.add_argument("--results", default="results/doctor/summary.csv", help="CSV of the doctor's own runs")
    p.add_argument("--report", default="results/doctor/REPORT.md", help="report of the doctor's runs")
    p.add_argument("--save-dir", default="results/doctor/checkpoints", help="the runs' model_final.pt files")
    p.set_defaults(log_dir="results/doctor/logs")


def _report_args(p):
    add_output_args(p)
    p.add_argument("--readme", nargs="?", const=os.path.join(ROOT, "README.md"), default=None,
                   help="also rewrite the README's generated tables (between its markers)")
    p.add_argument("--campaigns", default=os.path.join(ROOT, "results", "campaigns"),
                   help="with --readme: the campaign folders whose GPU rows fill the README's results table")


# name: (help, arguments, handler); `run` is the default when the first argument is no command
COMMANDS = {
    "run": ("run a preset of the matrix, then write the report", _run_args, cmd_run),
    "report": ("rewrite the report (and with --readme the README's tables) from the CSV", _report_args,
               cmd_report),
    "compare": ("ratio of median throughputs per run of two result CSVs with 95% CIs; exit 1 on a slowdown",
                _compare_args, cmd_compare),
    "doctor": ("print the environment a bug report needs, run the smoke preset, check its invariants",
               _doctor_args, cmd_doctor),
    "calibrate": ("measure the step model's inputs on this machine (compute per setup, collectives per world "
                  "size) into results/calibration.json", _calibrate_args, cmd_calibrate),
    "predict": ("predict the step time of rows already measured again, with this checkout's step model and a "
                "calibration, beside what they measured and predicted", _predict_args, cmd_predict),
    "advise": ("predicted memory per GPU of every strategy for a model, batch and GPU count, and which to use "
               "(no GPU needed)", _advise_args, cmd_advise),
}


def parse(argv: list[str]) -> argparse.Namespace:
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run"] + argv
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=OneLineParser)
    for name, (help_, add_args, handler) in COMMANDS.items():
        p = sub.add_parser(name, help=help_.replace("%", "%%"), description=help_)  # help is %-formatted
        if name == argv[0]:  # the named command's flags only: calibrate's, predict's and advise's import torch (2-4 s)
            add_args(p)
        p.set_defaults(handler=handler)
    opts = parser.parse_args(argv)
    for key in ("results", "report", "log_dir", "save_dir"):
        if getattr(opts, key, None):
            setattr(opts, key, os.path.abspath(getattr(opts, key)))
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    try:
        return opts.handler(opts)
    except UsageError as exc:
        print(f"benchmark.py: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, yaml.YAMLError, KeyError) as exc:
        first = (str(exc).splitlines() or [""])[0]  # a YAML error's text runs over several lines
        print(f"benchmark.py: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # stopped by SIGTERM (timeout, scancel, a CI's kill), the harness stops its launches as Ctrl-C does: they run
    # in sessions of their own (common/bench/matrix.py execute, calibrate.py _wait_all)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
