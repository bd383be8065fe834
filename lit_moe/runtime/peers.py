"""Which rank stopped answering: a one-line diagnosis instead of a gloo/NCCL traceback.

When a rank dies (SIGKILL, out of memory, a node lost) the others fail in their next collective
("Connection reset by peer" on gloo within milliseconds) or, when it hangs (SIGSTOP, a stuck
device), when the collective times out after ``parallelism.process_group_timeout_s``. The message
names a socket, not a rank.

:class:`PeerWatch` runs a heartbeat thread on every rank: once a second it increments the rank's
counter in the launch's store (torchrun's agent store, or the store rank 0 hosts under Lightning's
launcher; separate client connections, keys scoped by run id and restart attempt).
When a collective fails, the first rank to fail claims the diagnosis (one atomic ``add`` on the
store): it reads every counter, waits ``STALE_S`` seconds and reads them again (ranks whose counter
did not move stopped answering) and publishes the verdict; every other rank waits for that verdict
(three store operations each, instead of each of the W ranks reading all W counters twice:
8.4M round trips at 2,048 ranks). It prints one line naming them and the
failed collective's first line, and exits with status 1 at once (tearing down a broken process group
could hang). Under ``torchrun --max-restarts N`` the agent then restarts every worker, and they
auto-resume from the last checkpoint. When every rank still answers, the error is not a lost peer:
it propagates unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch import Callback

BEAT_S = 1.0
STALE_S = 3.0
VERDICT_WAIT_S = 10.0   # beyond STALE_S: how long a rank waits for the claimant's verdict


def is_collective_failure(err: BaseException) -> bool:
    """An error raised by a collective whose peer is gone or silent (gloo, NCCL, HCCL, the store)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    return any(w in text for w in ("gloo", "NCCL", "HCCL", "Connection reset by peer", "Connection closed by peer",
                                   "Timed out waiting", "Socket Timeout"))


class PeerWatch(Callback):
    """Heartbeats and the one-line diagnosis of a lost rank (see the module docstring)."""

    def __init__(self) -> None:
        self._store: Any = None
        self._reader: Any = None
        self._prefix = ""
        self._rank = 0
        self._world = 1
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._thread is not None or not (dist.is_available() and dist.is_initialized()):
            return
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        from lit_moe.runtime.elastic import AGENT_STORE_ENV

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if os.environ.get(AGENT_STORE_ENV):  # torchrun's agent store outlives every worker
            host, port = os.environ[AGENT_STORE_ENV].rsplit(":", 1)
        if self._world < 2 or not host or not port:
            return
        run = os.environ.get("TORCHELASTIC_RUN_ID", "") or os.environ.get("SLURM_JOB_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"lit_moe/heartbeat/{run}/{attempt}/"
        try:  # two client connections: the heartbeat thread never shares one with the diagnosis
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
            self._reader = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        except Exception:  # no reachable store: no diagnosis, errors propagate as they are
            self._store = self._reader = None
            return
        self._thread = threading.Thread(target=self._beat, name="lit_moe-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = f"{self._prefix}{self._rank}"
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except Exception:
                return
            self._stop.wait(BEAT_S)

    def silent_ranks(self) -> Optional[list[int]]:
        """Ranks whose heartbeat did not move for ``STALE_S`` seconds (None: the store is gone)."""
        keys = {r: f"{self._prefix}{r}" for r in range(self._world) if r != self._rank}
        try:
            before = {r: self._reader.add(k, 0) for r, k in keys.items()}
        except Exception:
            return None
        deadline = time.monotonic() + STALE_S
        while time.monotonic() < deadline:  # a signal handler may cut a sleep short
            time.sleep(max(0.0, deadline - time.monotonic()))
        try:
            after = {r: self._reader.add(k, 0) for r, k in keys.items()}
        except Exception:
            return None
        return [r for r in keys if after[r] == before[r]]

    def diagnose(self) -> Optional[list[int]]:
        """The silent ranks by the verdict of the first rank that failed (see the module docstring);
        None when the store stopped answering."""
        verdict = f"{self._prefix}diagnosis/verdict"
        try:
            claimed = self._reader.add(f"{self._prefix}diagnosis/claim", 1) == 1
        except Exception:
            return None
        if claimed:
            silent = self.silent_ranks()
            try:
                self._reader.set(verdict, json.dumps(silent))
            except Exception:
                pass
            return silent
        try:
            self._reader.wait([verdict], timedelta(seconds=STALE_S + VERDICT_WAIT_S))
            return json.loads(self._reader.get(verdict))
        except Exception:   # the claimant died before its verdict: this rank looks itself
            return self.silent_ranks()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._reader is None or not is_collective_failure(exception):
            return
        silent = self.diagnose()
        if silent == []:
            return  # every rank answers: not a lost peer, the error propagates unchanged
        first = " ".join(str(exception).split())[:240]
        if silent is None:
            who = "the rendezvous store stopped answering (rank 0 hosts it unless torchrun does)"
        else:
            names = ", ".join(map(str, silent))
            who = f"rank{'s' if len(silent) > 1 else ''} {names} stopped answering (no heartbeat for {STALE_S:.0f} s)"
        print(f"lit_moe: error: {who}; rank {self._rank} gives up: {type(exception).__name__}: {first}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop.set()
