"""Count the Python interpreters the test suite starts (``LIT_MOE_COUNT_STARTS=1 pytest ...``).

Each start costs seconds of imports (torch, Lightning) on a small machine, so the number of starts is
what keeps the suite lean. ``install()`` writes a ``sitecustomize.py`` to a temporary directory and
puts that directory first on ``PYTHONPATH``: every child interpreter that inherits the environment
(run_cli, torchrun's agent and its workers, Lightning's launcher) appends one line to a log, naming the
test that was running (pytest's ``PYTEST_CURRENT_TEST``, inherited too) and its command line. Forked
workers are not counted: they import nothing."""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
from pathlib import Path

_LOG_VAR = "LIT_MOE_START_LOG"

_SITECUSTOMIZE = '''\
import os, sys
_log = os.environ.get("{var}")
if _log:
    with open(_log, "a") as _f:
        _f.write(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0] + "\\t" + " ".join(sys.argv)[:200] + "\\n")
'''


def install() -> None:
    where = Path(tempfile.mkdtemp(prefix="lit_moe_starts_"))
    atexit.register(shutil.rmtree, where, True)
    (where / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(var=_LOG_VAR))
    os.environ[_LOG_VAR] = str(where / "starts.log")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)


def summary() -> list[str]:
    log = Path(os.environ.get(_LOG_VAR, "/nonexistent"))
    lines = log.read_text().splitlines() if log.exists() else []
    per_file = collections.Counter(line.split("::")[0] for line in lines)
    per_test = collections.Counter(line.split("\t")[0] for line in lines)
    out = [f"Python starts by the suite (besides pytest itself): {len(lines)}"]
    out += [f"  {n:4d}  {name}" for name, n in per_file.most_common()]
    out += ["  most per test:"] + [f"  {n:4d}  {name}" for name, n in per_test.most_common(15)]
    return out
