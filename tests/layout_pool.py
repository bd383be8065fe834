"""One ``torch.distributed.run`` launch per world size for the layout test files.

Each layout test file compares parallel layouts with one process; the layouts run in worker processes
that import torch, Lightning and lit_moe (8-12 s each on a small machine, more when it is busy). Every
file used to start its own launch per world size (five files at world 2, three at world 4). Here the
first file that needs a world size starts one launch for every *collected* file of that size (pytest
passes the collected modules in ``note_collected``), and each file reads its own results from it.

The worker side runs the files one after the other in the same ranks: each file's own worker function
(``WORKERS``) writes into its own directory, and the process group is torn down between files (each
file's worker starts its own, or lets Lightning start one). A file whose worker failed has no ``DONE``
marker: its tests fail with the launch's log; files that finished before it keep their results.

Run as ``python -m torch.distributed.run ... tests/layout_pool.py --worker OUT MODULE...``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from helpers import ROOT, child_env, scaled  # noqa: E402

# module -> (world sizes it launches, quiet-machine seconds per launch, how its worker is called).
# Files run in this order in one launch. test_step_layouts keeps its own launches: in a shared launch,
# after the other files, its first Lightning run timed out in a broadcast (not understood yet).
WORKERS = {
    "test_gradient_division": ((2,), 300, lambda m, world, out, names: m.worker_main(out)),
    "test_lora_parallel": ((2,), 400, lambda m, world, out, names: m.worker_main(out, names)),
    "test_parallel_numerics": ((2, 4), 300, lambda m, world, out, names: m.worker_main(names, out)),
    "test_context_parallel": ((2, 4), 900, lambda m, world, out, names: m.worker_main(names, out)),
    "test_pipeline": ((2, 4), 600, lambda m, world, out, names: m.worker(world, out, [])),
}

_collected: set[str] = set()
_launched: dict[int, tuple[Path, str]] = {}   # world -> (output directory, launch log)


def note_collected(module_names) -> None:
    """The test modules pytest will run (from ``conftest.pytest_collection_modifyitems``)."""
    _collected.clear()
    _collected.update(name for name in module_names if name in WORKERS)


def launch_seconds() -> float:
    """Quiet-machine seconds of every launch the collected files share: the test that starts them
    waits for all (conftest raises its timeout to this)."""
    return sum(seconds * len(worlds) for name, (worlds, seconds, _) in WORKERS.items() if name in _collected)


def job_names(module, world: int) -> list[str]:
    """The layouts of ``module`` at ``world`` (``EXTRA`` adds non-layout checks, as in
    test_parallel_numerics)."""
    layouts = getattr(module, "LAYOUTS", {})
    names = [n for n, s in layouts.items() if not isinstance(s, dict) or s.get("world", world) == world]
    return names + list(getattr(module, "EXTRA", {}).get(world, []))


def results(module_name: str, world: int, tmp_root: Path) -> Path:
    """The directory with ``module_name``'s results at ``world``, launching that world's pool once."""
    if world not in _launched:
        modules = [m for m in WORKERS if world in WORKERS[m][0] and (m in _collected or m == module_name)]
        out = tmp_root / f"pool_world{world}"
        out.mkdir(parents=True, exist_ok=True)
        timeout = scaled(sum(WORKERS[m][1] for m in modules))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(Path(__file__).resolve()), "--worker", str(out), *modules]
        try:
            proc = subprocess.run(cmd, env=child_env(TESTS), capture_output=True, text=True, timeout=timeout,
                                  cwd=str(ROOT))
            log = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        except subprocess.TimeoutExpired as e:
            log = f"the world-{world} launch ran past {timeout:.0f} s\n{e.stderr!s}"[-6000:]
        _launched[world] = (out, log)
    out, log = _launched[world]
    where = out / module_name
    if not (where / "DONE").exists():
        raise AssertionError(f"{module_name}'s world-{world} workers did not finish (one launch for "
                             f"{sorted(p.name for p in out.iterdir())}):\n{log}")
    return where


def worker_main(out_dir: str, module_names: list[str]) -> None:
    import torch.distributed as dist

    for name in module_names:
        module = importlib.import_module(name)
        out = Path(out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        world = int(__import__("os").environ["WORLD_SIZE"])
        try:
            WORKERS[name][2](module, world, str(out), job_names(module, world))
        except BaseException:
            (out / f"FAILED.rank{__import__('os').environ['RANK']}").write_text(traceback.format_exc())
            raise
        if dist.is_initialized():   # Lightning's runs leave theirs; the next file starts its own
            dist.barrier()
            dist.destroy_process_group()
        (out / "DONE").write_text("")


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    worker_main(sys.argv[i + 1], sys.argv[i + 2:])
