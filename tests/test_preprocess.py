"""``lit_moe preprocess``: output checked by hand and read back with megatron-core."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from lit_moe.data import IndexedDataset
from lit_moe.data.catalog import builtin_tokenizer_path
from lit_moe.data.preprocess import main
from test_data_support import megatron
from helpers import child_env, scaled  # noqa: E402
import launch_pool  # noqa: E402

TEXTS = ["Hello, world.", "", "Ünïcödé — ✓ text", "It is a truth universally acknowledged.\nSecond line."]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i}, ensure_ascii=False) + "\n")
    return str(path)


def run(*args):
    return main([str(a) for a in args] + ["--quiet"])


def test_jsonl_byte_tokenizer_read_by_megatron(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    assert run("--input", src, "--output-prefix", tmp_path / "out", "--tokenizer", "byte", "--workers", 1) == 0
    prefix = str(tmp_path / "out_text_document")
    theirs = megatron().indexed_dataset.IndexedDataset(prefix)
    assert theirs.index.dtype == np.uint16
    # one document per line, the empty text an empty document (no sequence, no EOD), as Megatron writes it
    assert theirs.document_indices.tolist() == [0, 1, 1, 2, 3]
    nonempty = [t for t in TEXTS if t]
    assert len(theirs) == len(nonempty)
    for i, text in enumerate(nonempty):
        assert theirs[i].tolist() == list(text.encode("utf-8")) + [256]
    ours = IndexedDataset(prefix)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)


def test_tokenizer_file_and_eod(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS, key="body")
    tok_path = builtin_tokenizer_path("austen")
    assert run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", tok_path, "--json-key", "body",
               "--workers", 2) == 0
    tok = Tokenizer.from_file(tok_path)
    ds = megatron().indexed_dataset.IndexedDataset(str(tmp_path / "o_body_document"))
    nonempty = [t for t in TEXTS if t]
    for i, text in enumerate(nonempty):
        assert ds[i].tolist() == tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<eod>")]
    # an explicit EOD token, and no EOD at all
    assert run("--input", src, "--output-prefix", tmp_path / "p", "--tokenizer", tok_path, "--json-key", "body",
               "--eod-token", "<pad>", "--workers", 1) == 0
    assert IndexedDataset(str(tmp_path / "p_body_document"))[0][-1] == 0
    assert run("--input", src, "--output-prefix", tmp_path / "q", "--tokenizer", tok_path, "--json-key", "body",
               "--no-append-eod") == 0
    assert IndexedDataset(str(tmp_path / "q_body_document"))[0].tolist() == tok.encode(TEXTS[0]).ids


def test_text_document_modes(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("ab\ncd\n\n\nef\n", encoding="utf-8")
    expect = {"file": [b"ab\ncd\n\n\nef\n"], "line": [b"ab", b"cd", b"ef"], "paragraph": [b"ab\ncd", b"ef"]}
    for mode, docs in expect.items():
        assert run("--input", src, "--output-prefix", tmp_path / mode, "--tokenizer", "byte",
                   "--text-documents", mode, "--workers", 1) == 0
        ds = IndexedDataset(str(tmp_path / f"{mode}_text_document"))
        assert [ds[i].tolist() for i in range(len(ds))] == [list(d) + [256] for d in docs], mode


def test_workers_and_compression_do_not_change_the_output(tmp_path):
    texts = [f"document {i} " + "lorem ipsum " * (i % 37) for i in range(3000)]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    with open(src, "rb") as f, gzip.open(tmp_path / "in.jsonl.gz", "wb") as g:
        g.write(f.read())
    assert run("--input", src, "--output-prefix", tmp_path / "one", "--tokenizer", "byte", "--workers", 1) == 0
    assert run("--input", tmp_path / "in.jsonl.gz", "--output-prefix", tmp_path / "two", "--tokenizer", "byte",
               "--workers", 2) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{suffix}").read_bytes() == (tmp_path / f"two_text_document{suffix}").read_bytes()


def test_several_inputs_are_concatenated_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["first", "second"])
    b = write_jsonl(tmp_path / "b.jsonl", ["third"])
    assert run("--input", a, b, "--output-prefix", tmp_path / "ab", "--tokenizer", "byte") == 0
    ds = IndexedDataset(str(tmp_path / "ab_text_document"))
    assert [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(3)] == ["first", "second", "third"]


@pytest.mark.parametrize("lines, message", [
    (['{"text": "ok"}', "{not json"], r"in\.jsonl: line 2: not valid JSON"),
    (['{"text": "ok"}', "", '{"other": "x"}'], r"in\.jsonl: line 3: no key 'text'"),
    (['{"text": 5}'], r"in\.jsonl: line 1: 'text' is int, not a string"),
])
def test_bad_input_lines(tmp_path, capsys, lines, message):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", "byte", "--workers", 2) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("lit_moe preprocess: error:")
    assert re.search(message, err), err
    assert not any(p.name.startswith("o_text_document") for p in tmp_path.iterdir())  # nothing half-written


def test_bad_arguments(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", ["x"])
    assert run("--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "o", "--tokenizer", "byte") == 2
    err = capsys.readouterr().err
    assert "--input:" in err and "missing.jsonl: no such file" in err
    assert run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", tmp_path / "nope.json") == 2
    assert "nope.json: no such tokenizer file" in capsys.readouterr().err
    assert run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", builtin_tokenizer_path("austen"),
               "--eod-token", "<missing>") == 2
    assert "'<missing>' is not in the vocabulary" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", bad) == 2
    assert "not a tokenizers JSON file" in capsys.readouterr().err


def test_command_line_shows_progress(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["some text"] * 50)
    proc = launch_pool.run(["-m", "lit_moe.data.preprocess", "--input", src, "--output-prefix",
                            str(tmp_path / "cli"), "--tokenizer", "byte", "--workers", "2"], env=dict(os.environ),
                           timeout=scaled(120), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert "preprocess: 100%" in proc.stderr  # the progress bar
    assert "50 documents" in proc.stdout and "cli_text_document" in proc.stdout


def write_parquet(path, texts, key="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: texts, "id": list(range(len(texts)))}), str(path), row_group_size=7)
    return str(path)


def test_parquet_input_matches_jsonl(tmp_path, capsys):
    texts = [f"row {i}: " + "words " * (i % 5) for i in range(40)] + [""]
    src = write_parquet(tmp_path / "in.parquet", texts, key="body")
    jsonl = write_jsonl(tmp_path / "in.jsonl", texts, key="body")
    for workers in (1, 2):
        assert run("--input", src, "--output-prefix", tmp_path / f"pq{workers}", "--tokenizer", "byte",
                   "--json-key", "body", "--workers", workers) == 0
    assert run("--input", jsonl, "--output-prefix", tmp_path / "js", "--tokenizer", "byte", "--json-key", "body") == 0
    ds = IndexedDataset(str(tmp_path / "pq1_body_document"))
    assert [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(len(ds))] == [t for t in texts if t]
    for prefix in ("pq2", "js"):
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"pq1_body_document{suffix}").read_bytes() == \
                (tmp_path / f"{prefix}_body_document{suffix}").read_bytes()
    # a missing column and a non-string cell are one-line errors naming the file
    assert run("--input", src, "--output-prefix", tmp_path / "bad", "--tokenizer", "byte", "--workers", 2) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "in.parquet: no column 'text'" in err, err
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ok", None]}), str(tmp_path / "none.parquet"))
    assert run("--input", tmp_path / "none.parquet", "--output-prefix", tmp_path / "n", "--tokenizer", "byte") == 2
    assert "none.parquet: row 2: 'text' is NoneType, not a string" in capsys.readouterr().err
    assert not any(p.name.startswith(("bad_", "n_")) for p in tmp_path.iterdir())


def test_hugging_face_tokenizer_directory(tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    hf_dir = tmp_path / "hf_tok"
    # EOD is the directory's eos_token (here <pad>, not the first EOD candidate <eod> a bare
    # tokenizer.json would give)
    PreTrainedTokenizerFast(tokenizer_file=builtin_tokenizer_path("austen"), eos_token="<pad>",
                            bos_token="<eod>").save_pretrained(hf_dir)
    assert (hf_dir / "tokenizer_config.json").is_file()
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    assert run("--input", src, "--output-prefix", tmp_path / "d", "--tokenizer", hf_dir, "--workers", 2) == 0
    tok = Tokenizer.from_file(builtin_tokenizer_path("austen"))
    ds = IndexedDataset(str(tmp_path / "d_text_document"))
    nonempty = [t for t in TEXTS if t]
    for i, text in enumerate(nonempty):
        assert ds[i].tolist() == tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<pad>")]
    assert run("--input", src, "--output-prefix", tmp_path / "e", "--tokenizer", hf_dir, "--eod-token", "<nope>") == 2
    assert "'<nope>' is not in the vocabulary" in capsys.readouterr().err
    (hf_dir / "tokenizer.json").unlink()
    assert run("--input", src, "--output-prefix", tmp_path / "f", "--tokenizer", hf_dir) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a loadable Hugging Face tokenizer directory" in err, err


def test_progress_bar_reports_tokens_per_second(tmp_path):
    src = write_parquet(tmp_path / "in.parquet", ["some text"] * 50)
    proc = launch_pool.run(["-m", "lit_moe.data.preprocess", "--input", src, "--output-prefix",
                            str(tmp_path / "cli"), "--tokenizer", "byte", "--workers", "1"], env=dict(os.environ),
                           timeout=scaled(120), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"preprocess: 100%.*tokens/s", proc.stderr), proc.stderr
    # 50 documents of 9 bytes + EOD
    assert "50 documents, 500 tokens" in proc.stdout and "tokens/s" in proc.stdout


HANGING_SIGTERM = """
import json, signal, sys, time
from lit_moe.data.preprocess import main
signal.signal(signal.SIGTERM, lambda s, f: time.sleep(3600))  # a caller's handler that a fork would inherit
d = sys.argv[1]
with open(d + "/good.jsonl", "w") as f:
    f.writelines(json.dumps({"text": "lorem ipsum " * (i % 37)}) + "\\n" for i in range(3000))
with open(d + "/bad.jsonl", "w") as f:
    f.writelines(json.dumps({"text": "ok " * (i % 37)}) + "\\n" for i in range(2000))
    f.write("{not json\\n")
    f.writelines(json.dumps({"text": "ok " * (i % 37)}) + "\\n" for i in range(2000))
for name, want in (("good", 0), ("bad", 2)) * 3:
    code = main(["--input", f"{d}/{name}.jsonl", "--output-prefix", f"{d}/{name}", "--tokenizer", "byte",
                 "--workers", "2", "--quiet"])
    assert code == want, (name, code)
print("done")
"""


def test_workers_end_whatever_sigterm_handler_the_caller_has(tmp_path):
    """The CI hang of stop 36: a pool worker forked from a process whose SIGTERM handler does not exit
    (there: a leaked run's preemption handler) never ended in Pool.terminate. Workers reset it."""
    proc = subprocess.Popen([sys.executable, "-c", HANGING_SIGTERM, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=scaled(90))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the hung workers too
        out, err = proc.communicate()
        pytest.fail(f"preprocess with 2 workers hung under the caller's SIGTERM handler: {err[-2000:]}")
    assert proc.returncode == 0 and out.strip() == "done", err[-2000:]
