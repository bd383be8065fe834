import os

# Keep tests quiet and single-threaded per process where subprocesses run in parallel.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture
def one_process_strategy():
    """``AscendFSDPStrategy()`` for a Trainer inside the test process. Lightning initialises a
    one-rank process group and sets ``MASTER_ADDR``/``MASTER_PORT`` in ``os.environ``; both are undone
    afterwards, so later tests (and the subprocesses they launch) start clean."""
    import torch.distributed as dist

    from lit_moe.strategies import AscendFSDPStrategy

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                            "NODE_RANK")}
    yield AscendFSDPStrategy
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
