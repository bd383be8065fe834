"""``lit_moe convert-config`` then ``lit_moe plan`` over configs covering every key family of MindFormers'
MoE configs (``tests/data/convert_families/``, written for the tests, not copied): legacy research/
predict configs, mcore pretrain configs with graph-compilation and weight-layout switches, fine-tuning
from ``pretrained_model_dir`` with an HFDataLoader, MindRecord training data; and the refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_moe.tools.convert_config import main
from lit_moe.strategies.plan import main as plan_main

DATA = Path(__file__).parent / "data"
FAMILIES = DATA / "convert_families"
TINY_HF = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
           "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
           "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 32,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "n_group": 4,
           "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
           "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000,
           "use_cache": True, "torch_dtype": "bfloat16", "transformers_version": "4.46.0"}


def family(tmp_path: Path, name: str, **changes) -> Path:
    """The fixture with its placeholders filled in (and top-level keys changed), written under tmp_path."""
    pretrained = tmp_path / "hf"
    pretrained.mkdir(exist_ok=True)
    (pretrained / "config.json").write_text(json.dumps(TINY_HF))
    text = (FAMILIES / f"{name}.yaml").read_text()
    text = text.replace("@PRETRAINED@", str(pretrained)).replace("@MINDRECORD@", str(DATA / "mindrecord" / "one"))
    if changes:
        data = yaml.safe_load(text)
        for dotted, value in changes.items():
            *parents, leaf = dotted.split(".")
            node = data
            for p in parents:
                node = node[p]
            node[leaf] = value
        text = yaml.safe_dump(data, sort_keys=False)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def convert(capsys, path: Path, *args: str) -> tuple[dict, list[str]]:
    out = path.with_suffix(".pynative.yaml")
    assert main([str(path), "-o", str(out), *args]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err.splitlines()
    return yaml.safe_load(out.read_text()), err


def plans(capsys, converted: dict, tmp_path: Path, world: int) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(converted, sort_keys=False))
    assert plan_main(["--config", str(path), "--world-size", str(world)]) == 0
    capsys.readouterr()


def dropped_notes(err: list[str]) -> dict[str, str]:
    """``key: reason; dropped`` notes by key."""
    notes = [ln.split("note: ", 1)[1] for ln in err if "note: " in ln and ln.endswith("; dropped")]
    return {n.split(": ", 1)[0]: n.split(": ", 1)[1] for n in notes}


def test_legacy_predict_config(tmp_path, capsys):
    pyn, err = convert(capsys, family(tmp_path, "legacy_predict"))
    notes = dropped_notes(err)
    inference = ("batch_size", "use_past", "block_size", "num_blocks", "checkpoint_name_or_path", "repetition_penalty",
                 "max_decode_length", "top_k", "top_p", "do_sample", "is_dynamic", "quantization_config")
    for key in inference:
        assert notes[f"model.model_config.{key}"].startswith("inference only"), key
    for key in ("qkv_concat", "ffn_concat"):
        assert "weight tensors" in notes[f"model.model_config.{key}"]
    for key in ("model.arch", "model.model_config.type", "model.model_config.auto_register", "model.model_config.auto_map"):
        assert "registration" in notes[key]
    assert "multiple_of" in " ".join(notes) and "-100 is what lit_moe does" in notes["model.model_config.ignore_token_id"]
    assert any("run_mode 'predict': the model is converted" in ln and "lit_moe predict" in ln for ln in err)
    m = pyn["model"]
    # legacy names → lit_moe's; moe_config → model; scaling_factor dict and extend_method YARN → YaRN keys
    assert (m["num_attention_heads"], m["num_layers"], m["params_dtype"], m["layernorm_compute_dtype"],
            m["softmax_compute_dtype"], m["rope_theta"]) == (4, 2, "float32", "float32", "float32", 10000.0)
    assert (m["n_routed_experts"], m["num_experts_per_tok"], m["n_shared_experts"], m["topk_group"]) == (8, 2, 1, 2)
    assert (m["position_embedding_type"], m["scaling_factor"], m["original_max_position_embeddings"]) == ("yarn", 4.0, 1024)
    assert "lr_scheduler" not in pyn and "steps" not in pyn["training"]   # nothing trains in a predict config
    assert "context" not in pyn                                         # affinity_cpu_list: None
    plans(capsys, pyn, tmp_path, 2)


def test_mcore_pretrain_config(tmp_path, capsys):
    pyn, err = convert(capsys, family(tmp_path, "pretrain_mcore"))
    notes = dropped_notes(err)
    for key in ("input_sliced_sig", "use_fused_mla", "moe_router_fusion"):
        assert "graph-mode compilation" in notes[f"model.model_config.{key}"]
    for key in ("qkv_concat", "use_contiguous_weight_layout_attention", "use_interleaved_weight_layout_mlp"):
        assert "weight tensors" in notes[f"model.model_config.{key}"]
    for key in ("moe_z_loss_coeff", "fp32_residual_connection"):
        assert "is what lit_moe does" in notes[f"model.model_config.{key}"]
    assert "graph-mode router does not read it" in notes["model.model_config.moe_router_pre_softmax"]
    for key in ("layer_scale", "layer_decay", "lr_scale_factor"):
        assert "off (layer_scale is false)" in notes[key]
    assert any("'qk_layernorm' is given twice" in ln and "the last one is used" in ln for ln in err)
    # MindFormers' rule: dataset size 40 // (2 × dp 2) = 10 batches, sink_size 4: int(10 / 4 × 3) × 4 = 28
    assert pyn["training"]["steps"] == 28 and pyn["training"]["global_batch_size"] == 4
    assert pyn["checkpoint"] == {"remove_redundancy": True, "prefix": "tiny", "save_interleaved_steps": 10,
                                 "save_max": 2, "async_save": False}
    assert pyn["model"]["qk_layernorm"] is True and pyn["parallelism"]["expert_parallel"] == 2
    plans(capsys, pyn, tmp_path, 2)


def test_finetune_from_pretrained_model_dir_with_hf_data(tmp_path, capsys):
    path = family(tmp_path, "finetune_hf")
    assert main([str(path), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr_schedule.total_steps: -1" in err[0] and "HFDataLoader" in err[0] and "--steps" in err[0]
    pyn, err = convert(capsys, path, "--steps", "6")
    m = pyn["model"]
    # config.json gives the dimensions, model.model_config overrides (dtypes, seq_length)
    assert (m["hidden_size"], m["n_routed_experts"], m["seq_length"], m["compute_dtype"]) == (64, 8, 32, "bfloat16")
    assert any("keys from" in ln and "config.json" in ln for ln in err)
    assert any("HFDataLoader has no lit_moe loader yet" in ln for ln in err)
    assert "config.json use_cache" in " ".join(dropped_notes(err))
    assert pyn["training"]["steps"] == 6
    # plan validates the layout and the model; the HF data section is for the user to replace before fit
    pyn["train_dataset"] = {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "sizes": [8, 0, 0],
                                           "config": {"seq_length": 32}}}
    plans(capsys, pyn, tmp_path, 1)


def test_pretrained_model_dir_without_config_json(tmp_path, capsys):
    path = family(tmp_path, "finetune_hf", pretrained_model_dir="/path/to/DeepSeek-V3")
    assert main([str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pretrained_model_dir: '/path/to/DeepSeek-V3' has no config.json" in err[0]
    assert "--pretrained-model-dir" in err[0]
    pyn, _ = convert(capsys, path, "--steps", "2", "--pretrained-model-dir", str(tmp_path / "hf"))
    assert pyn["model"]["hidden_size"] == 64


def test_mindrecord_training_config(tmp_path, capsys):
    pyn, err = convert(capsys, family(tmp_path, "mindrecord_train"))
    dl = pyn["train_dataset"]["dataloader"]
    assert dl == {"type": "MindDataset", "dataset_files": str(DATA / "mindrecord" / "one"), "shuffle": False,
                  "column_names": ["input_ids", "labels", "loss_mask", "position_ids"], "python_multiprocessing": False}
    # total_steps -1, no sink mode: epochs 2 × (7 rows of the MindRecord file // global batch 1)
    assert pyn["training"]["steps"] == 14
    plans(capsys, pyn, tmp_path, 1)


@pytest.mark.parametrize("name,changes,message", [
    ("pretrain_mcore", {"model.model_config.architectures": ["Qwen3ForCausalLM"]},
     r"model\.model_config\.architectures: 'Qwen3ForCausalLM' is not implemented: lit_moe trains DeepSeek-V3, "
     r"Qwen3-MoE and GLM-4-MoE"),
    ("legacy_predict", {"model.arch.type": "TelechatForCausalLM"}, r"model\.arch\.type: 'TelechatForCausalLM'"),
    ("mindrecord_train", {"model.model_config.model_type": None, "trainer.model_name": "qwen3"},
     r"trainer\.model_name: 'qwen3' builds MindFormers' qwen3 model"),
    ("pretrain_mcore", {"grouped_lr_schedule": {"default": {"type": "ConstantWarmUpLR"}}},
     r"grouped_lr_schedule: per-parameter-group learning-rate schedules are not implemented yet"),
    ("pretrain_mcore", {"layer_scale": True}, r"layer_scale: True \(layer-wise learning-rate decay\) is not implemented"),
    ("legacy_predict", {"model.model_config.ignore_token_id": 0}, r"ignore_token_id: 0 is not implemented yet"),
    ("legacy_predict", {"model.model_config.extend_method": "NTK"}, r"extend_method: 'NTK' is not implemented yet"),
    ("mindrecord_train", {"train_dataset.data_loader.dataset_dir": "/nowhere"},
     r"lr_schedule\.total_steps: -1 .*the MindRecord data cannot be counted .*pass --steps N"),
    ("pretrain_mcore", {"lr_schedule.total_steps": 0}, r"lr_schedule\.total_steps: expected a positive integer, -1 or null"),
])
def test_refused_by_name_in_one_line(tmp_path, capsys, name, changes, message):
    import re

    assert main([str(family(tmp_path, name, **changes)), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


@pytest.mark.timeout(600)
def test_qwen3_moe_pretrain_config_converts_plans_and_trains(tmp_path, capsys):
    """MindFormers' configs/qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml, shrunk: the Qwen3-MoE family with its
    router keys (num_experts, routed_scaling_factor 1.5, moe_router_pre_softmax, gbs_aux_loss)."""
    from helpers import run_cli

    source = tmp_path / "qwen3_moe_pretrain.yaml"   # converted beside a copy: the output stays out of the repository
    source.write_text((FAMILIES / "qwen3_moe_pretrain.yaml").read_text())
    pyn, err = convert(capsys, source)
    notes = dropped_notes(err)
    assert "graph-mode router does not read it" in notes["model.model_config.moe_router_pre_softmax"]
    assert any("'gbs_aux_loss' → 'aux_loss'" in ln and "global batch" in ln for ln in err)
    m = pyn["model"]
    assert (m["model_type"], m["qk_layernorm"], m["n_routed_experts"], m["routed_scaling_factor"],
            m["moe_router_load_balancing_type"], m["head_dim"]) == ("qwen3_moe", True, 8, 1.5, "aux_loss", 16)
    assert pyn["parallelism"]["expert_parallel"] == 2
    plans(capsys, pyn, tmp_path, 2)

    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    built = DeepseekV3Config(**read_pynative_model_section(m))
    assert (built.multi_latent_attention, built.scoring_func, built.n_shared_experts, built.norm_topk_prob,
            built.num_nextn_predict_layers, built.kv_heads, built.moe_aux_loss_coeff) == (
        False, "softmax", 0, False, 0, 2, 0.001)

    # one process trains a step on mock documents (the data_path is a placeholder)
    cfg = pyn["train_dataset"]["dataloader"]["config"]
    cfg.pop("data_path")
    cfg.update(mock=True, vocab_size=m["vocab_size"])
    pyn["train_dataset"]["num_parallel_workers"] = 0
    pyn["parallelism"]["expert_parallel"] = 1
    pyn["training"]["steps"] = 1
    pyn["model"].update(compute_dtype="float32", seq_length=32)   # the shrunk data's (the YAML relies on 4096)
    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text(yaml.safe_dump(pyn, sort_keys=False))
    result = run_cli(["fit", "--config", str(run_cfg)], cwd=tmp_path, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1/1" in result.stdout + result.stderr
