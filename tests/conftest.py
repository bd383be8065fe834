import os

# Keep tests quiet and single-threaded per process where subprocesses run in parallel.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import start_counter  # noqa: E402  (tests/ is on sys.path, as for helpers)
from helpers import scaled  # noqa: E402

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


# The files whose tests take longest (their multi-rank launches), slowest first, from the durations of
# a fresh-clone run on the 2-core machine. Under pytest-xdist (``--dist loadfile``) they are handed
# out first, so that no long file starts last and runs alone while the other worker idles.
SLOWEST_FILES = ["test_step_layouts.py", "test_pipeline.py", "test_memory_plan.py", "test_strategy_launch.py",
                 "test_predict.py", "test_context_parallel.py", "test_elastic.py", "test_hostile_inputs.py",
                 "test_family_v4.py", "test_checkpoint_e2e.py", "test_mindformers_keys.py",
                 "test_parallel_numerics.py", "test_resilience.py"]


def pytest_configure(config):
    """``LIT_MOE_COUNT_STARTS=1``: count every Python interpreter the suite starts (see
    ``start_counter.py``); the count, per test file, is printed at the end. Under xdist's ``loadfile``
    the files are handed out in collection order (``pytest_collection_modifyitems``), not by test count."""
    if os.environ.get("LIT_MOE_COUNT_STARTS") == "1":
        start_counter.install()
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """The slowest files first (``SLOWEST_FILES``), the rest in their usual order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("LIT_MOE_COUNT_STARTS") == "1":
        for line in start_counter.summary():
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    """Each test's timeout (its ``timeout`` mark, else the ini's 600 s) is for a quiet machine: it is ``scaled`` by the load when the test
    starts, before pytest-timeout reads it, so a correct test on a busy machine is not killed."""
    marker = item.get_closest_marker("timeout")
    base = marker.args[0] if marker is not None and marker.args else float(item.config.getini("timeout") or 0)
    if base:
        item.add_marker(pytest.mark.timeout(scaled(base)), append=False)
    yield
