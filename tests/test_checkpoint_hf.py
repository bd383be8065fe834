"""Hugging Face import (``load_path`` = a ``save_pretrained`` directory) and export
(``lit_moe convert-hf``), checked against ``transformers.DeepseekV3ForCausalLM`` (an independent
implementation): the exported checkpoint gives the same logits there as our model does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import randomize_norms_and_biases

TINY = dict(
    model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    max_position_embeddings=256, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", moe_router_enable_expert_bias=True, num_nextn_predict_layers=1,
    params_dtype="float32", compute_dtype="float32", rms_norm_eps=1e-6, seq_length=16,
    qk_layernorm=True,   # stated: a pynative.yaml without it gets MindFormers' default (False)
)


class Holder(torch.nn.Module):
    """Stands for the LightningModule: checkpoints name the model's tensors ``model.…``."""

    def __init__(self, model):
        super().__init__()
        self.model = model


def _model(seed: int = 3):
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY))
    # non-unit norms and non-zero expert biases, so that a swapped or dropped one in the export shows
    randomize_norms_and_biases(model, seed=seed)
    return model.eval()


def _save_iteration(model, save_path: Path, step: int = 5) -> Path:
    from lit_moe.checkpoint.comm import Comm
    from lit_moe.checkpoint.iteration import SaveJob, make_common, prepare, write_and_commit
    from lit_moe.checkpoint.sharded import pieces_of

    comm = Comm(None)
    common = make_common(step, 1, "x", has_optimizer=False)
    prepare(comm, save_path, step)
    return write_and_commit(comm, SaveJob(save_path, step, "x", pieces_of(Holder(model).state_dict()), None,
                                          rng_json="{}", common=common))


def _yaml(tmp_path: Path, model: dict) -> Path:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": model}))
    return path


def test_convert_hf_matches_transformers_logits(tmp_path):
    import transformers  # the judge: a hard test dependency (pyproject [test])
    from lit_moe.hf.convert import main

    model = _model()
    _save_iteration(model, tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["--config", str(_yaml(tmp_path, TINY)), "--checkpoint", str(tmp_path / "ckpt"),
                 "--output", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = hf_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=3e-7)   # measured 3.0e-8 (logits up to 0.44)
    assert not torch.allclose(ours, _model(seed=4)(ids).logits, atol=1e-3)  # a different model differs


def test_convert_hf_wrong_config_names_tensors(tmp_path, capsys):
    from lit_moe.hf.convert import main

    _save_iteration(_model(), tmp_path / "ckpt")
    bigger = {**TINY, "hidden_size": 48}
    assert main(["--config", str(_yaml(tmp_path, bigger)), "--checkpoint", str(tmp_path / "ckpt"),
                 "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.embed_tokens.weight: checkpoint [96, 32] vs model [96, 48]" in err
    assert not (tmp_path / "hf").exists()
    assert main(["--config", str(_yaml(tmp_path, TINY)), "--checkpoint", str(tmp_path / "missing"),
                 "--output", str(tmp_path / "hf")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_hf_directory_as_load_path(tmp_path):
    from lit_moe.checkpoint import CheckpointError, resolve_load
    from lit_moe.hf.checkpoint import save_pretrained
    from lit_moe.config import CheckpointConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    source = _model()
    save_pretrained(source, tmp_path / "hf")
    config = DeepseekV3Config(**TINY)
    # full resume from a Hugging Face directory: MindFormers' error
    with pytest.raises(CheckpointError, match=r"Resume training \(no_load_optim=False\) is not supported for "
                                              "HuggingFace checkpoints"):
        resolve_load(CheckpointConfig(load_path=str(tmp_path / "hf")), config)
    plan = resolve_load(CheckpointConfig(load_path=str(tmp_path / "hf"), no_load_optim=True), config)
    assert plan.kind == "huggingface" and plan.ckpt_path is None
    torch.manual_seed(11)
    target = DeepseekV3ForCausalLM(config)
    plan.weights_loader(target)
    src, dst = source.state_dict(), target.state_dict()
    assert src.keys() == dst.keys()
    for k in src:
        assert src[k].equal(dst[k]), k
    # another model's shapes: one line naming the tensors
    other = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, "moe_intermediate_size": 24}))
    with pytest.raises(CheckpointError) as err:
        plan.weights_loader(other)
    assert "\n" not in str(err.value) and "mlp.experts.0.gate_proj.weight: checkpoint [16, 32] vs model [24, 32]" \
        in str(err.value)


def test_weights_only_from_iteration_into_bare_model(tmp_path):
    """``no_load_optim: True`` on one of our checkpoints fills the model given to ``weights_loader``
    (a bare DeepseekV3ForCausalLM, while the checkpoint names tensors as the LightningModule does)."""
    from lit_moe.checkpoint import resolve_load
    from lit_moe.config import CheckpointConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    source = _model()
    _save_iteration(source, tmp_path / "ckpt", step=7)
    config = DeepseekV3Config(**TINY)
    plan = resolve_load(CheckpointConfig(load_path=str(tmp_path / "ckpt"), no_load_optim=True), config)
    assert plan.kind == "weights" and plan.step == 7
    torch.manual_seed(5)
    target = DeepseekV3ForCausalLM(config)
    plan.weights_loader(target)
    assert all(source.state_dict()[k].equal(v) for k, v in target.state_dict().items())
    # resolve_load compares shapes with the model the config builds, before anything starts
    from lit_moe.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: checkpoint \[64, 32\] vs "
                                              r"model \[80, 32\]"):
        resolve_load(CheckpointConfig(load_path=str(tmp_path / "ckpt"), no_load_optim=True),
                     DeepseekV3Config(**{**TINY, "intermediate_size": 80}))
    common = json.loads((tmp_path / "ckpt" / "iteration_00000007" / "common.json").read_text())
    assert common["has_optimizer"] is False
