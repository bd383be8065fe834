"""``torchrun --max-restarts N``: every restart attempt rendezvouses in a store of its own.

torchrun's agent hosts one TCPStore for its whole life and its workers build their process groups
in it (``TORCHELASTIC_USE_AGENT_STORE``). The keys those groups write (each rank's gloo address, the
group counters) have the same names in every attempt, so after a restart a fast worker reads the
address a dead worker of the previous attempt published: "Gloo connectFullMesh failed ... Connection
refused", or a hang, and the restart is lost.

:func:`fresh_rendezvous` runs before the process group exists: rank 0 picks a free port and
publishes it in the agent store under a key of this attempt; every rank then initialises through
``env://`` with rank 0 hosting a new store on that port (``TORCHELASTIC_USE_AGENT_STORE=False``),
so nothing from an earlier attempt can be read. The agent store stays reachable
(``LIT_MOE_AGENT_STORE``) for :mod:`lit_moe.runtime.peers`, because it outlives any worker.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

AGENT_STORE_ENV = "LIT_MOE_AGENT_STORE"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return int(s.getsockname()[1])


def fresh_rendezvous(timeout_s: float) -> None:
    """Under torchrun's agent store: move this attempt's rendezvous to a new store (module docstring).
    A no-op elsewhere, and when it already ran in this process."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or AGENT_STORE_ENV in env:
        return
    import torch.distributed as dist

    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    rank = int(env.get("RANK", "0"))
    key = f"lit_moe/rendezvous/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/port"
    agent = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        new_port = _free_port(host)
        agent.set(key, str(new_port))
    else:
        new_port = int(agent.get(key).decode())
    env[AGENT_STORE_ENV] = f"{host}:{port}"
    env["MASTER_PORT"] = str(new_port)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
