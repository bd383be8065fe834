import os

# Keep tests quiet and single-threaded per process where subprocesses run in parallel.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
