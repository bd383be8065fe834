"""One-off: write MindRecord files with MindSpore's own FileWriter, read them back with MindDataset."""
import json, os, sys, shutil
import numpy as np
from mindspore.mindrecord import FileWriter
import mindspore.dataset as ds

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True); os.makedirs(out)
rng = np.random.RandomState(0)
S = 16
def sample(i):
    ids = rng.randint(0, 129280, size=S + 1).astype(np.int32)
    ids[3] = -1; ids[5] = 127; ids[6] = -129; ids[7] = 40000; ids[8] = -40000
    ends = np.array([5, 11, S] if i % 2 else [S], dtype=np.int32)
    return {"input_ids": ids[:-1], "labels": ids[1:].copy(), "loss_mask": (rng.rand(S) > 0.2).astype(np.int32),
            "position_ids": np.arange(S, dtype=np.int32) % 7,
            "attention_mask": np.tril(np.ones((4, 4), dtype=np.int32)) * (i + 1),
            "actual_seq_len": ends, "weights": rng.rand(3).astype(np.float32),
            "big": np.array([2**40 + i, -(2**33)], dtype=np.int64), "idx": i}

schema = {"input_ids": {"type": "int32", "shape": [-1]}, "labels": {"type": "int32", "shape": [-1]},
          "loss_mask": {"type": "int32", "shape": [-1]}, "position_ids": {"type": "int32", "shape": [-1]},
          "attention_mask": {"type": "int32", "shape": [4, 4]}, "actual_seq_len": {"type": "int32", "shape": [-1]},
          "weights": {"type": "float32", "shape": [-1]}, "big": {"type": "int64", "shape": [2]}, "idx": {"type": "int64"}}
results = {}
for name, shards, n, cols in [("one", 1, 7, list(schema)), ("two", 2, 11, list(schema)),
                              ("ids", 1, 5, ["input_ids"])]:
    path = os.path.join(out, name, "data.mindrecord")
    os.makedirs(os.path.dirname(path))
    w = FileWriter(path, shard_num=shards, overwrite=True)
    w.set_header_size(1 << 14); w.set_page_size(1 << 15)
    w.add_schema({k: schema[k] for k in cols}, "test")
    rows = [sample(i) for i in range(n)]
    rows = [{k: r[k] for k in cols} for r in rows]
    # two write calls: rows land in the page groups of two batches
    w.write_raw_data(rows[: n // 2]); w.write_raw_data(rows[n // 2:])
    w.commit()
    files = sorted(os.path.join(os.path.dirname(path), f) for f in os.listdir(os.path.dirname(path)) if not f.endswith(".db"))
    reads = {}
    for key, kw in [("all", {}), ("shard0of2", {"num_shards": 2, "shard_id": 0}), ("shard1of2", {"num_shards": 2, "shard_id": 1}),
                    ("shard2of3", {"num_shards": 3, "shard_id": 2})]:
        d = ds.MindDataset(files, columns_list=cols, shuffle=False, **kw)
        reads[key] = [{k: v.tolist() for k, v in row.items()} for row in d.create_dict_iterator(output_numpy=True, num_epochs=1)]
    # files given in reverse order
    d = ds.MindDataset(files[::-1], columns_list=cols, shuffle=False)
    reads["reversed"] = [{k: v.tolist() for k, v in row.items()} for row in d.create_dict_iterator(output_numpy=True, num_epochs=1)]
    results[name] = {"files": [os.path.basename(f) for f in files], "reads": reads,
                     "written": [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()} for r in rows]}
json.dump(results, open(os.path.join(out, "expected.json"), "w"))
for name in results:
    print(name, {k: [r.get("idx", r["input_ids"][0]) for r in v] for k, v in results[name]["reads"].items()})

# big/: written by the following (MindSpore 2.10.0), several blob pages and raw row groups:
#   rng = np.random.RandomState(1); S = 300
#   rows = [{"input_ids": rng.randint(-5, 200000, size=S).astype(np.int32),
#            "labels": rng.randint(0, 300, size=S).astype(np.int32), "loss_mask": np.ones(S, np.int32),
#            "position_ids": np.arange(S, dtype=np.int32)} for i in range(40)]
#   w = FileWriter("big/big.mindrecord", shard_num=1, overwrite=True)
#   w.set_header_size(1 << 14); w.set_page_size(1 << 15)
#   w.add_schema({k: {"type": "int32", "shape": [-1]} for k in rows[0]}, "big"); w.write_raw_data(rows); w.commit()
