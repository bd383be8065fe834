import os

# Keep tests quiet and single-threaded per process where subprocesses run in parallel.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    """A Trainer run inside the test process leaves Lightning's ``MASTER_PORT`` etc. in os.environ;
    a later test's subprocess launch inheriting them would reuse a port this process may still
    listen on (EADDRINUSE). Each test starts with the variables it found."""
    saved = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def one_process_strategy():
    """``AscendFSDPStrategy()`` for a Trainer inside the test process. Lightning initialises a
    one-rank process group; it is destroyed afterwards (and the launch variables it set are undone by
    ``_launch_variables_restored``), so later tests and the subprocesses they launch start clean."""
    import torch.distributed as dist

    from lit_moe.strategies import AscendFSDPStrategy

    yield AscendFSDPStrategy
    if dist.is_initialized():
        dist.destroy_process_group()
