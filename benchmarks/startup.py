"""Start-up: how long from the command to the first training step, and how promptly SIGTERM is obeyed
while starting.

    python benchmarks/startup.py                                  # this CPU, configs/tiny.yaml
    python benchmarks/startup.py --env ONEDNN_MAX_CPU_ISA=AVX2    # as on a CPU without native bf16
    python benchmarks/startup.py --steps 200                      # the whole quick start, timed

Measured, each in a fresh process (``--repeats`` times, best and median):

* ``import lit_moe.cli``: ``python -c 'import lit_moe.cli'`` wall time;
* ``lit_moe fit --config configs/tiny.yaml --training.steps N`` (checkpoints off, output under a
  temporary directory; the tokenized corpus cache shared by the runs, so the first run builds it as
  a fresh clone's first run does and the others reuse it, as every later run does): seconds from the command to the run's summary line (config validated, model
  built), to the ``MFU peak`` line (the peak probe done, training starts) and to the end of step 1, and
  the whole run;
* SIGTERM during start-up: sent when the summary line appears (the peak probe and the first step
  are still ahead); seconds until the process exits, and its exit status.

Targets (issue 25): first step <= 15 s on a quiet 2-core machine; the 200-step quick start <= 3 min;
SIGTERM obeyed within seconds (before the probe had a budget, it could take minutes).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
MARKS = {"summary": "lit_moe: model ", "peak": "MFU peak:", "step 1": "step 1/"}


def child_env(extra: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def time_import(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import lit_moe.cli"], env=env, check=True)
    return time.perf_counter() - start


def fit_command(config: str, steps: int, work: str) -> list[str]:
    return [sys.executable, "-m", "lit_moe.cli", "fit", "--config", config, "--training.steps", str(steps),
            "--checkpoint.enable_save", "False", "--checkpoint.save_path", os.path.join(work, "ckpt"),
            "--monitor.tensorboard.output_dir", os.path.join(work, "tb"), "--monitor.tensorboard.log_interval", "1"]


def time_fit(config: str, steps: int, env: dict, sigterm_at: Optional[str] = None,
             verbose: bool = False) -> dict:
    """Seconds from the command to each mark (and to the exit); with ``sigterm_at`` a mark name,
    SIGTERM is sent when that mark's line appears."""
    with tempfile.TemporaryDirectory(prefix="lit_moe_startup_") as work:
        start = time.perf_counter()
        proc = subprocess.Popen(fit_command(config, steps, work), cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        seen: dict[str, float] = {}
        sent = None
        for line in proc.stdout:
            now = time.perf_counter() - start
            if verbose:
                print(f"   [{now:7.2f}s] {line.rstrip()[:160]}")
            for mark, text in MARKS.items():
                if mark not in seen and line.startswith(text):
                    seen[mark] = now
            if sigterm_at and sigterm_at in seen and sent is None:
                proc.send_signal(signal.SIGTERM)
                sent = now
        rc = proc.wait()
        end = time.perf_counter() - start
    return {"marks": seen, "exit": end, "rc": rc, "sigterm_sent": sent}


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):6.2f} s best, {statistics.median(values):6.2f} s median"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--steps", type=int, default=2, help="training steps of each timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the timed processes, e.g. ONEDNN_MAX_CPU_ISA=AVX2")
    p.add_argument("--skip-sigterm", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print the runs' output with timestamps")
    args = p.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in args.env)
    cache = tempfile.TemporaryDirectory(prefix="lit_moe_startup_cache_")
    env = child_env({"LIT_MOE_CACHE": cache.name, **extra})
    load0 = os.getloadavg()
    print(f"== startup: {args.config}, {args.steps} steps, {os.cpu_count()} CPUs, env {extra or '{}'}, "
          f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")

    imports = [time_import(env) for _ in range(args.repeats)]
    print(f"   import lit_moe.cli        {fmt(imports)}")
    runs = [time_fit(args.config, args.steps, env, verbose=args.verbose) for _ in range(args.repeats + 1)]
    failed = [r["rc"] for r in runs if r["rc"] != 0]
    first, runs = runs[0], runs[1:]
    print(f"   first run (builds the corpus cache): step 1 line after {first['marks'].get('step 1', float('nan')):.2f} s")
    for mark in MARKS:
        print(f"   command → {mark + ' line':14s} {fmt([r['marks'][mark] for r in runs if mark in r['marks']])}")
    print(f"   command → exit ({args.steps} steps) {fmt([r['exit'] for r in runs])}"
          + (f"; FAILED runs, exit status {failed}" if failed else ""))
    if not args.skip_sigterm:
        stops = [time_fit(args.config, args.steps, env, sigterm_at="summary", verbose=args.verbose)
                 for _ in range(args.repeats)]
        delays = [r["exit"] - r["sigterm_sent"] for r in stops if r["sigterm_sent"] is not None]
        print(f"   SIGTERM at the summary line → exit {fmt(delays)}; exit status {[r['rc'] for r in stops]}")
    cache.cleanup()
    load1 = os.getloadavg()
    print(f"   load average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
