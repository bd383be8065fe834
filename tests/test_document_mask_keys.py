"""MindFormers' attention-mask model keys (issue 17): ``use_eod_attn_mask_compression`` means what it
means in MindFormers' PyNative trainer (attention within the documents of the batch's
``actual_seq_len``; turned on by data with ``create_compressed_eod_mask``; True without that
column is one line naming the dataset key), ``use_attn_mask_compression`` (Ascend's compressed
plain-causal mask) is accepted without effect."""

from __future__ import annotations

import pytest
import torch

from helpers import ROOT, cli_in_process
from lit_moe.config import NO_EFFECT_KEYS, ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.model.config_parsing import check_document_mask_data

DOCS_LOADER = {"config": {"create_compressed_eod_mask": True},
               "column_names": ["input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len"]}


def test_compressed_eod_data_turns_the_flag_on_as_mindformers_does():
    cfg = DeepseekV3Config()
    assert cfg.use_eod_attn_mask_compression is False
    check_document_mask_data(cfg, DOCS_LOADER)
    assert cfg.use_eod_attn_mask_compression is True
    # default column_names (null) are the produced columns, actual_seq_len among them
    cfg = DeepseekV3Config(use_eod_attn_mask_compression=True)
    check_document_mask_data(cfg, {"config": {"create_compressed_eod_mask": True}})
    plain = DeepseekV3Config()
    check_document_mask_data(plain, {"config": {"create_compressed_eod_mask": False}})
    assert plain.use_eod_attn_mask_compression is False


@pytest.mark.parametrize("loader, eval_loader, words", [
    ({"config": {"create_compressed_eod_mask": False}}, None,
     "train_dataset.dataloader.config.create_compressed_eod_mask is false"),
    ({"config": {}}, None, "train_dataset.dataloader.config.create_compressed_eod_mask is false"),
    ({"config": {"create_compressed_eod_mask": True}, "column_names": ["input_ids", "labels"]}, None,
     "train_dataset.dataloader.column_names ['input_ids', 'labels'] leaves out 'actual_seq_len'"),
    (DOCS_LOADER, {"dataloader": {"config": {"create_compressed_eod_mask": False}}},
     "eval_dataset.dataloader.config.create_compressed_eod_mask is false"),
])
def test_flag_without_document_ends_is_one_line(loader, eval_loader, words):
    with pytest.raises(ConfigError) as err:
        check_document_mask_data(DeepseekV3Config(use_eod_attn_mask_compression=True), loader, eval_loader)
    msg = str(err.value)
    assert msg.startswith("model.use_eod_attn_mask_compression: True") and words in msg and "\n" not in msg, msg


def test_document_ends_keep_attention_within_documents():
    """What the flag selects: with ``actual_seq_len`` in the batch the logits of a packed sample
    equal those of each document run alone, unlike plain causal attention over the whole sample.
    (The model builds this mask whenever the column is there; the flag's part is to require it.)"""
    torch.manual_seed(0)
    section = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                   kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=1, topk_group=1, seq_length=12, max_position_embeddings=64,
                   compute_dtype="float32", use_eod_attn_mask_compression=True)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**section)).eval()
    model.init_weights(3)
    ids = torch.randint(0, 64, (1, 12))
    ends = [5, 12]
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=positions, actual_seq_len=torch.tensor([ends])).logits
        alone = torch.cat([model(ids[:, :5]).logits, model(ids[:, 5:]).logits], dim=1)
        causal = model(ids, position_ids=positions).logits
    assert torch.allclose(packed, alone, atol=1e-5)
    assert not torch.allclose(causal[:, 5:], alone[:, 5:], atol=1e-3)


def test_mask_compression_is_listed_without_effect_and_eod_is_a_field():
    assert "model.use_attn_mask_compression" in NO_EFFECT_KEYS
    assert "model.use_eod_attn_mask_compression" not in NO_EFFECT_KEYS
    assert DeepseekV3Config(use_attn_mask_compression=True) == DeepseekV3Config()
    with pytest.raises(ConfigError, match=r"model.use_eod_attn_mask_compression: expected bool"):
        DeepseekV3Config(use_eod_attn_mask_compression="yes")


def test_fit_with_the_flag_and_no_document_ends_is_one_line(tmp_path, capfd):
    proc = cli_in_process(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
                           "--model.use_eod_attn_mask_compression", "true"], capfd, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "train_dataset.dataloader.config.create_compressed_eod_mask is false" in lines[0], lines
