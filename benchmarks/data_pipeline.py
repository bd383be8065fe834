"""Data pipeline benchmark: GPTDataset index build for 1M documents, blending, sample reads, preprocessing.

    python benchmarks/data_pipeline.py [--docs 1000000] [--mb 50] [--workers 2]

Prints one line per measurement. Targets (issue 3): index build of 1M documents < 10 s; preprocessing
with the byte tokenizer >= 5 MB/s of text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lit_moe.data import GPTDataset, GPTDatasetConfig, IndexedDataset  # noqa: E402
from lit_moe.data.indexed import write_index  # noqa: E402
from lit_moe.data.blended import build_blending_indices  # noqa: E402
from lit_moe.data.preprocess import main as preprocess_main  # noqa: E402


def report(name: str, **values) -> None:
    print(json.dumps({"benchmark": name, **{k: (round(v, 4) if isinstance(v, float) else v)
                                            for k, v in values.items()}}), flush=True)


def sparse_dataset(prefix: str, n_docs: int, seed: int = 0) -> int:
    """An indexed dataset of n_docs documents of 1..4095 tokens (lengths as in Megatron's mock data).
    The .bin is a sparse file of the right size: building indices reads only the .idx."""
    lengths = np.random.default_rng(seed).integers(1, 4096, n_docs)
    write_index(prefix + ".idx", np.int32, lengths, np.arange(n_docs + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 4)
    return int(lengths.sum())


def bench_index(tmp: str, n_docs: int, seq_length: int) -> None:
    prefix = os.path.join(tmp, "sparse")
    tokens = sparse_dataset(prefix, n_docs)
    cfg = GPTDatasetConfig.from_dict({"seq_length": seq_length, "eod": 0, "create_attention_mask": False,
                                      "path_to_cache": os.path.join(tmp, "cache")})
    low = IndexedDataset(prefix)
    num_samples = 2 * tokens // seq_length  # two epochs
    t0 = time.perf_counter()
    ds = GPTDataset(low, prefix, np.arange(n_docs), num_samples, "train", cfg)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    GPTDataset(low, prefix, np.arange(n_docs), num_samples, "train", cfg)
    reload = time.perf_counter() - t0
    report("gpt_index_build", documents=n_docs, tokens=tokens, seq_length=seq_length, samples=len(ds),
           seconds=build, cached_reload_seconds=reload, target_seconds=10.0, ok=build < 10.0)


def bench_blend(size: int) -> None:
    for weights in ([0.3, 0.7], [0.1, 0.2, 0.3, 0.4]):
        t0 = time.perf_counter()
        build_blending_indices(weights, size)
        report("blend_indices", datasets=len(weights), samples=size, seconds=time.perf_counter() - t0)


def bench_reads(tmp: str) -> None:
    from lit_moe.data import build_datasets

    for flags in ({}, {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True,
                       "create_attention_mask": True}):
        section = {"type": "BlendedMegatronDatasetDataLoader", "sizes": [2000, 0, 0],
                   "config": {"seq_length": 1024, "split": "1,0,0", "eod": 1, "pad": -1,
                              "create_attention_mask": False, "data_path": ["1", "builtin:austen"],
                              "path_to_cache": tmp, **flags}}
        train = build_datasets(section)[0]
        t0 = time.perf_counter()
        n = 300
        for i in range(n):
            train[i]
        dt = time.perf_counter() - t0
        report("sample_reads", seq_length=1024, flags=sorted(flags), samples_per_s=n / dt)


def bench_preprocess(tmp: str, megabytes: int, workers: int) -> None:
    rng = random.Random(0)
    words = ("the of and to in that was his he it with is for as had you not be her on at by which have or "
             "from this him but all she they were my are me one their so an said them we who would been will no "
             "when there if more out up into do any your what has man could other than our some very time upon "
             "about may its only now like little then can should made did us such a great before must two these").split()
    src = os.path.join(tmp, "bench.jsonl")
    text_bytes = 0
    with open(src, "w") as f:
        while text_bytes < megabytes * 1_000_000:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(100, 3000)))
            f.write(json.dumps({"text": text}) + "\n")
            text_bytes += len(text)
    for tokenizer in ("byte", "builtin:austen"):
        t0 = time.perf_counter()
        rc = preprocess_main(["--input", src, "--output-prefix", os.path.join(tmp, "out"), "--tokenizer", tokenizer,
                              "--workers", str(workers), "--quiet"])
        dt = time.perf_counter() - t0
        report("preprocess", tokenizer=tokenizer, workers=workers, text_mb=text_bytes / 1e6,
               file_mb=os.path.getsize(src) / 1e6, seconds=dt, text_mb_per_s=text_bytes / 1e6 / dt,
               target_mb_per_s=5.0 if tokenizer == "byte" else None,
               ok=(text_bytes / 1e6 / dt >= 5.0) if tokenizer == "byte" else None, rc=rc)
        if tokenizer != "byte":
            break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--mb", type=int, default=50, help="megabytes of text to preprocess")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_index(tmp, args.docs, args.seq_length)
        bench_blend(args.blend_samples)
        bench_reads(tmp)
        bench_preprocess(tmp, args.mb, args.workers)


if __name__ == "__main__":
    main()
