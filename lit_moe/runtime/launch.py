"""The world a launch will build, known before any process group exists.

``lit_moe fit`` sizes gradient accumulation (``global_batch_size / (dp · local_batch_size)``) and the
memory check before the strategy starts, so it must know the number of processes the strategy will
build. Lightning takes that number from its cluster environment, in this order (its
``_choose_and_init_cluster_environment``): torchrun (``WORLD_SIZE``, torchelastic variables
present), then SLURM (``SLURM_NTASKS`` under ``srun``, unless the job is named ``bash`` or
``interactive``), else its own launcher (``--trainer.devices`` × ``--trainer.num_nodes``).

:func:`launch_world` follows the same order and also fills in the Trainer's ``devices`` and
``num_nodes`` the user did not set from the launcher (``LOCAL_WORLD_SIZE``,
``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``): without them Lightning's per-node device list is
shorter than the local ranks (``IndexError`` in ``root_device`` under ``srun`` without
``--trainer.devices``) or the strategy's node count differs from the world. Values the user did set
must agree with the launcher; when they do not, the run stops with one line naming both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from lit_moe.config import ConfigError


@dataclass(frozen=True)
class LaunchWorld:
    """The processes of a launch: ``world_size = devices × num_nodes`` (per-node processes × nodes)."""

    world_size: int
    devices: int
    num_nodes: int
    launcher: str   # "torchrun", "srun" or "lightning"


def _int_env(env: Mapping[str, str], key: str) -> Optional[int]:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected an integer (set by the launcher)") from None


def _explicit_int(trainer_cfg: Mapping[str, Any], key: str, explicit: Optional[set]) -> Optional[int]:
    """``trainer.KEY`` as an integer when the user set it (``explicit`` None: any non-default value)."""
    value = trainer_cfg.get(key)
    if explicit is not None and key not in explicit:
        return None
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def is_torchrun(env: Mapping[str, str]) -> bool:
    """torch's ``is_torchelastic_launched`` on ``env`` (what Lightning's TorchElasticEnvironment detects)."""
    return "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env


def is_srun(env: Mapping[str, str]) -> bool:
    """Lightning's SLURM detection: ``SLURM_NTASKS`` set and the job not named bash/interactive."""
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def launch_world(trainer_cfg: Mapping[str, Any], explicit: Optional[set] = None,
                 env: Optional[Mapping[str, str]] = None,
                 auto_devices: Callable[[], int] = lambda: 1) -> LaunchWorld:
    """The world the strategy will build (module docstring); ``explicit``: the ``trainer`` keys the user
    set (None: every value in ``trainer_cfg`` counts as set); ``auto_devices``: Lightning's device count
    for ``devices: auto`` under its own launcher."""
    env = os.environ if env is None else env
    devices = _explicit_int(trainer_cfg, "devices", explicit)
    nodes = _explicit_int(trainer_cfg, "num_nodes", explicit)
    if is_torchrun(env):
        world = _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_WORLD_SIZE") or devices or world
        return _agree("torchrun", world, local, devices, nodes, "WORLD_SIZE", "LOCAL_WORLD_SIZE (--nproc_per_node)",
                      None)
    if is_srun(env):
        world = _int_env(env, "SLURM_NTASKS")
        per_node = _int_env(env, "SLURM_NTASKS_PER_NODE")
        slurm_nodes = _int_env(env, "SLURM_NNODES")
        if per_node is None:
            if world > 1:   # Lightning's SLURMEnvironment refuses it too (with a traceback)
                raise ConfigError(f"SLURM_NTASKS={world} without SLURM_NTASKS_PER_NODE: launch with srun "
                                  "--ntasks-per-node=N (one task per device) and --nodes=M")
            per_node = 1
        return _agree("srun", world, per_node, devices, nodes, "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                      slurm_nodes)
    if "WORLD_SIZE" in env and devices is None:   # a process Lightning's own launcher started
        return LaunchWorld(_int_env(env, "WORLD_SIZE"), _int_env(env, "LOCAL_WORLD_SIZE") or 1, nodes or 1,
                           "lightning")
    devices = devices if devices is not None else _auto_or_all(trainer_cfg, auto_devices)
    nodes = nodes or 1
    return LaunchWorld(devices * nodes, devices, nodes, "lightning")


def _auto_or_all(trainer_cfg: Mapping[str, Any], auto_devices: Callable[[], int]) -> int:
    value = trainer_cfg.get("devices", "auto")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return auto_devices()   # "auto", -1, "-1"


def _agree(launcher: str, world: int, per_node: int, devices: Optional[int], nodes: Optional[int],
           world_key: str, per_node_key: str, launcher_nodes: Optional[int]) -> LaunchWorld:
    if devices is not None and devices != per_node:
        raise ConfigError(f"--trainer.devices {devices} differs from {per_node_key}={per_node} of the {launcher} "
                          f"launch; leave --trainer.devices unset (it follows the launcher) or launch "
                          f"{devices} processes per node")
    if launcher_nodes is not None and nodes is not None and nodes != launcher_nodes:
        raise ConfigError(f"--trainer.num_nodes {nodes} differs from SLURM_NNODES={launcher_nodes}; leave "
                          "--trainer.num_nodes unset (it follows the launcher) or allocate that many nodes")
    if nodes is None:
        nodes = launcher_nodes if launcher_nodes is not None else max(world // max(per_node, 1), 1)
    if per_node * nodes != world:
        raise ConfigError(f"{world_key}={world} processes, but --trainer.num_nodes {nodes} × {per_node_key}="
                          f"{per_node} gives {per_node * nodes}; set --trainer.num_nodes {world // per_node}"
                          if world % per_node == 0 else
                          f"{world_key}={world} is not a multiple of {per_node_key}={per_node} processes per node")
    return LaunchWorld(world, per_node, nodes, launcher)


def check_built_world(expected: Optional[int], built: int) -> None:
    """The strategy's process group has the world accumulation was sized for (else one line)."""
    if expected is not None and built != expected:
        raise ConfigError(f"the launch built {built} processes but the run was sized for {expected} "
                          "(--trainer.devices × --trainer.num_nodes, WORLD_SIZE or SLURM_NTASKS disagree); "
                          "set --trainer.num_nodes and --trainer.devices to the launcher's nodes and "
                          "processes per node")
