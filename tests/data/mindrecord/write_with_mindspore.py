"""One-off (not run by the tests): write the MindRecord fixtures of this directory with MindSpore's own
FileWriter and record what MindSpore's MindDataset reads from them (mindspore_reads.json).

    pip install mindspore==2.10.0   # in a separate environment
    python tests/data/mindrecord/write_with_mindspore.py tests/data/mindrecord
"""
import json
import os
import shutil
import sys

import mindspore.dataset as ds
from mindspore.mindrecord import FileWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from mindrecord_writer import SCHEMA, big_rows, fixture_rows  # noqa: E402

out = sys.argv[1]


def write(path, schema, rows, shards=1, desc="test", batches=2):
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os.makedirs(os.path.dirname(path))
    w = FileWriter(path, shard_num=shards, overwrite=True)
    w.set_header_size(1 << 14)
    w.set_page_size(1 << 15)
    w.add_schema(schema, desc)
    cut = len(rows) // batches
    for part in (rows[:cut], rows[cut:]) if batches == 2 else (rows,):
        w.write_raw_data(part)
    w.commit()


results = {}
rows = fixture_rows()
for name, shards in (("one", 1), ("two", 2), ("ids", 1)):
    cols = list(rows[name][0])
    path = os.path.join(out, name, "data.mindrecord")
    write(path, {k: SCHEMA[k] for k in cols}, rows[name], shards)
    files = sorted(os.path.join(out, name, f) for f in os.listdir(os.path.join(out, name)) if not f.endswith(".db"))
    reads = {}
    for key, kw, order in (("all", {}, files), ("reversed", {}, files[::-1]),
                           ("shard0of2", {"num_shards": 2, "shard_id": 0}, files),
                           ("shard1of2", {"num_shards": 2, "shard_id": 1}, files),
                           ("shard2of3", {"num_shards": 3, "shard_id": 2}, files)):
        d = ds.MindDataset(order, columns_list=cols, shuffle=False, **kw)
        reads[key] = [{k: v.tolist() for k, v in r.items()} for r in d.create_dict_iterator(output_numpy=True, num_epochs=1)]
    results[name] = {"files": [os.path.basename(f) for f in files], "reads": reads}
json.dump(results, open(os.path.join(out, "mindspore_reads.json"), "w"), separators=(",", ":"))

big = big_rows()
write(os.path.join(out, "big", "big.mindrecord"), {k: {"type": "int32", "shape": [-1]} for k in big[0]}, big,
      desc="big", batches=1)
d = ds.MindDataset([os.path.join(out, "big", "big.mindrecord")], columns_list=list(big[0]), shuffle=False)
got = [{k: v.tolist() for k, v in r.items()} for r in d.create_dict_iterator(output_numpy=True, num_epochs=1)]
assert got == [{k: v.tolist() for k, v in r.items()} for r in big], "MindDataset read big/ differently"
