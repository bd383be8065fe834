"""Hugging Face DeepSeek-V3 checkpoints: ``config.json`` + safetensors (sharded with an index when large).

On-disk names are the real DeepSeek-V3 ones, which ``transformers.DeepseekV3ForCausalLM`` loads:

| ours | Hugging Face |
|---|---|
| ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight`` | ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` |
| ``layers.{i}.self_attention.*`` | ``model.layers.{i}.self_attn.*`` (DeepSeek-V3.2's ``indexer.*`` included) |
| ``layers.{i}.pre_mlp_layernorm`` | ``model.layers.{i}.post_attention_layernorm`` |
| ``layers.{i}.mlp.router.weight`` / ``.expert_bias`` | ``model.layers.{i}.mlp.gate.weight`` / ``.e_score_correction_bias`` |
| ``layers.{i}.mlp.experts.gate_up_proj [E, H, 2I]`` | ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` / ``up_proj.weight`` ``[I, H]`` |
| ``layers.{i}.mlp.experts.down_proj [E, I, H]`` | ``model.layers.{i}.mlp.experts.{j}.down_proj.weight [H, I]`` |
| ``mtp.{k}.{enorm,hnorm,eh_proj}`` | ``model.layers.{L+k}.{enorm,hnorm,eh_proj}`` |
| ``mtp.{k}.final_layernorm`` | ``model.layers.{L+k}.shared_head.norm`` |
| ``mtp.{k}.layer.*`` | ``model.layers.{L+k}.*`` (as a decoder layer) |

MTP layers also get copies of the shared embedding and head (``model.layers.{L+k}.embed_tokens`` and
``.shared_head.head``), as in the DeepSeek release; they are ignored when loading. Reading also
accepts transformers' merged expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``). FP8 block-quantized checkpoints (the original DeepSeek-V3
release: ``weight`` in ``float8_e4m3fn`` with a ``weight_scale_inv`` per 128×128 block) load
dequantized (:mod:`lit_moe.model.safetensors_io`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch

from lit_moe.hf import v4 as hf_v4

from lit_moe.hf import families as hf_families
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.names import canonical_name, spelled
from lit_moe.model.safetensors_io import (CONFIG_FILE, FP8_DTYPES, INDEX_FILE, SINGLE_FILE, SafetensorsError,
                                          WeightDirectory)

log = logging.getLogger(__name__)


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory that cannot be read or written as DeepSeek-V3."""


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def export_problems(config: DeepseekV3Config) -> list[str]:
    """Why ``config`` has no Hugging Face DeepSeek-V3 equivalent (empty when it has one)."""
    c = config
    problems = []
    if c.normalization != "RMSNorm":
        problems.append(f"model.normalization: {c.normalization!r} (Hugging Face DeepSeek-V3 uses RMSNorm)")
    if not c.qk_layernorm:
        problems.append("model.qk_layernorm: False (Hugging Face DeepSeek-V3 always normalises the latents)")
    if c.position_embedding_type not in ("rope", "yarn"):
        problems.append(f"model.position_embedding_type: {c.position_embedding_type!r} (Hugging Face supports rope/yarn)")
    if c.nope_layer_interval:
        problems.append(f"model.nope_layer_interval: {c.nope_layer_interval!r} (every Hugging Face layer uses RoPE)")
    if c.window_size is not None:
        problems.append(f"model.window_size: {c.window_size!r} (no sliding windows in Hugging Face DeepSeek-V3)")
    if c.n_routed_experts and c.scoring_func != "sigmoid":
        problems.append(f"model.scoring_func: {c.scoring_func!r} (Hugging Face DeepSeek-V3 routes with sigmoid)")
    if c.moe_layer_freq != 1:
        problems.append(f"model.moe_layer_freq: {c.moe_layer_freq!r} (Hugging Face supports 1)")
    if c.n_routed_experts and c.shared_expert_intermediate_size != c.n_shared_experts * c.moe_intermediate_size:
        problems.append(f"model.moe_shared_expert_intermediate_size: {c.moe_shared_expert_intermediate_size!r} "
                        "(Hugging Face uses n_shared_experts * moe_intermediate_size)")
    return problems


def hf_config_dict(config: DeepseekV3Config, dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face DeepSeek-V3 model (plus our full config under ``lit_moe``);
    the other families' in ``lit_moe.hf.families``."""
    if config.model_type == "deepseek_v4":
        problems = hf_v4.export_problems(config)
        if problems:
            raise HFCheckpointError("cannot write a Hugging Face deepseek_v4 checkpoint: " + "; ".join(problems))
        return hf_v4.hf_config_dict(config, dtype)
    if config.model_type in hf_families.FAMILIES:
        problems = hf_families.export_problems(config) + hf_v4.pieces_problems(config)
        if problems:
            raise HFCheckpointError(f"cannot write a Hugging Face {config.model_type} checkpoint: " + "; ".join(problems))
        return hf_families.hf_config_dict(config, dtype)
    problems = export_problems(config) + hf_v4.pieces_problems(config)
    if problems:
        raise HFCheckpointError("cannot write a Hugging Face DeepSeek-V3 checkpoint: " + "; ".join(problems))
    c = config
    dense_only = not c.n_routed_experts
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_nextn_predict_layers": c.num_nextn_predict_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "n_shared_experts": c.n_shared_experts,
        "n_routed_experts": c.n_routed_experts or 1,
        "routed_scaling_factor": c.routed_scaling_factor,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "n_group": c.n_group if c.group_limited else 1,
        "topk_group": c.topk_group if c.group_limited else 1,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_layer_freq": 1,
        "first_k_dense_replace": c.num_hidden_layers if dense_only else c.first_k_dense_replace,
        "norm_topk_prob": c.norm_topk_prob,
        "scoring_func": "sigmoid",
        "hidden_act": ("gelu_pytorch_tanh" if c.hidden_act == "gelu" and c.gelu_approximate == "tanh"
                       else "silu" if c.hidden_act == "fusedswiglu" else c.hidden_act),
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": str(dtype or c.torch_dtype("params_dtype")).replace("torch.", ""),
        "lit_moe": c.to_dict(),
    }
    if c.sparse_attention:
        d = hf_families.sparse_mla_config_dict(d, c)
    if c.position_embedding_type == "yarn":
        d["rope_scaling"] = {
            "type": "yarn", "factor": c.scaling_factor,
            "original_max_position_embeddings": c.yarn_original_length,
            "beta_fast": c.beta_fast, "beta_slow": c.beta_slow,
            "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim,
        }
    return d


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> DeepseekV3Config:
    """Our config from a ``config.json`` dict (ours: its ``lit_moe`` block; otherwise the HF keys)."""
    quant = hf.get("quantization_config") or {}
    if quant and not is_block_fp8(quant):
        raise HFCheckpointError(
            f"config.json: quantization_config.quant_method={quant.get('quant_method')!r}: only DeepSeek's FP8 "
            "block quantization (quant_method 'fp8' with a 2-D weight_block_size) is read (dequantized); "
            "dequantize the weights to bf16 first")
    if hf.get("rope_interleave") is False:
        raise HFCheckpointError("config.json: rope_interleave=False is not supported (DeepSeek weights rotate "
                                "interleaved pairs)")
    kinds = ("deepseek_v3", hf_families.SPARSE_MLA, *hf_families.FAMILIES, "deepseek_v4")
    if hf.get("model_type") not in (None, *kinds):
        raise HFCheckpointError(f"config.json: model_type={hf.get('model_type')!r}, expected one of "
                                + ", ".join(map(repr, kinds)))
    if isinstance(hf.get("lit_moe"), dict):
        base = dict(hf["lit_moe"])
    elif hf.get("model_type") == "deepseek_v4":
        base = hf_v4.section_from_hf(hf)
    elif hf.get("model_type") in hf_families.FAMILIES:
        base = hf_families.section_from_hf(hf)
    elif hf.get("model_type") == hf_families.SPARSE_MLA:
        base = hf_families.sparse_mla_section(hf)
    else:
        base = dict(hf)
    base.update(overrides)
    return DeepseekV3Config(**base)


def is_block_fp8(quant: dict[str, Any]) -> bool:
    """DeepSeek-V3's ``quantization_config``: FP8 weights with one ``weight_scale_inv`` per block
    (``weight_block_size``, 128×128), loaded dequantized (:mod:`lit_moe.model.safetensors_io`)."""
    block = quant.get("weight_block_size", [128, 128])
    return (quant.get("quant_method") == "fp8" and isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block))


# ----------------------------------------------------------------------------------------------
# key mapping
# ----------------------------------------------------------------------------------------------
Slicer = Callable[[torch.Tensor], torch.Tensor]   # our tensor -> view in Hugging Face orientation
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(enorm|hnorm|eh_proj|final_layernorm|layer)\.(.+)$")
_EXPERTS = re.compile(r"^(.+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_WHOLE: Slicer = lambda t: t  # noqa: E731


def hf_keys(name: str, shape: torch.Size, num_hidden_layers: int,
            config: Optional[DeepseekV3Config] = None) -> list[tuple[str, Slicer]]:
    """Hugging Face keys (with views) that hold our tensor ``name`` (canonical name): its Hugging Face
    spelling (``lit_moe.model.names``, the one name map), the merged expert tensors split per expert.
    With ``config`` of a family whose routers have no expert bias (Qwen3-MoE), none for the bias."""
    top_level = name in ("embed_tokens.weight", "norm.weight", "lm_head.weight") or name.startswith("hc_head.")
    if not (top_level or _LAYER.match(name) or _MTP.match(name)):
        raise HFCheckpointError(f"{name}: no Hugging Face DeepSeek-V3 equivalent")
    if config is not None and config.model_type == "deepseek_v4":
        return [(hf_v4.release_name(key), view) for key, view in _v3_keys(name, shape, num_hidden_layers, config)]
    return _v3_keys(name, shape, num_hidden_layers, config)


def _v3_keys(name: str, shape: torch.Size, num_hidden_layers: int,
             config: Optional[DeepseekV3Config]) -> list[tuple[str, Slicer]]:
    if config is not None and name.endswith(".router.expert_bias") and not hf_families.exports_expert_bias(config):
        return []
    experts = _EXPERTS.match(name)
    if experts is None:
        return [(spelled(name, "huggingface", num_hidden_layers), _WHOLE)]
    prefix = spelled(experts.group(1), "huggingface", num_hidden_layers) + ".mlp.experts"
    E = shape[0]
    if experts.group(2) == "gate_up_proj":
        I = shape[2] // 2
        out = []
        for j in range(E):
            out.append((f"{prefix}.{j}.gate_proj.weight", lambda t, j=j: t[j, :, :I].t()))
            out.append((f"{prefix}.{j}.up_proj.weight", lambda t, j=j: t[j, :, I:].t()))
        return out
    return [(f"{prefix}.{j}.down_proj.weight", lambda t, j=j: t[j].t()) for j in range(E)]


def _merged_expert_key(hf_key: str) -> Optional[tuple[str, int, str]]:
    """``...mlp.experts.{j}.gate_proj.weight`` → (merged key, j, part) for transformers' merged layout."""
    m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", hf_key)
    if not m:
        return None
    merged = m.group(1) + (".down_proj" if m.group(3) == "down_proj" else ".gate_up_proj")
    return merged, int(m.group(2)), m.group(3)


def _canonical_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in model.state_dict(keep_vars=True).items():
        yield canonical_name(name), t


# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------
def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise HFCheckpointError(f"max_shard_size: cannot parse {size!r} (e.g. 5GB, 500MB or a byte count)")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base ** power)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save_pretrained(model: torch.nn.Module, directory: Union[str, os.PathLike],
                    max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None) -> None:
    """Write ``model`` (a ``DeepseekV3ForCausalLM``) as a Hugging Face DeepSeek-V3 directory.

    ``dtype``: storage dtype of the weights (default: as they are); the router weight and expert bias
    stay fp32, as transformers keeps them. Sharded files + ``model.safetensors.index.json`` when the
    total exceeds ``max_shard_size``. DTensor parameters are gathered (every rank must call); only rank
    0 writes."""
    from safetensors.torch import save_file

    config: DeepseekV3Config = model.config
    hf_cfg = hf_config_dict(config, dtype)

    tensors = dict(_canonical_tensors(model))
    shards = shard_entries(export_entries({k: (t.shape, t.dtype) for k, t in tensors.items()}, config, dtype),
                           max_shard_size)

    writer = not (torch.distributed.is_available() and torch.distributed.is_initialized()
                  and torch.distributed.get_rank() != 0)
    directory = Path(directory)
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    full_cache: dict[str, torch.Tensor] = {}
    for s, shard in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        for e in shard:
            if e.name not in full_cache:
                full_cache = {e.name: _full(tensors[e.name]).detach()}   # keep one gathered tensor at a time
            out[e.hf_key] = e.view(full_cache[e.name]).to(device="cpu", dtype=e.dtype, copy=True).contiguous()
        if writer:
            save_file(out, str(directory / shard_file_name(s, len(shards))), metadata={"format": "pt"})
    if writer:
        write_index_and_config(directory, shards, hf_cfg)


class ExportEntry(NamedTuple):
    """One tensor of a Hugging Face directory: where it comes from and how it is stored."""
    hf_key: str
    name: str               # our canonical tensor name it is a view of
    view: Slicer            # our tensor -> this tensor (Hugging Face orientation)
    dtype: torch.dtype      # stored dtype
    nbytes: int


def export_entries(tensors: dict[str, tuple[torch.Size, torch.dtype]], config: DeepseekV3Config,
                   dtype: Optional[torch.dtype]) -> list[ExportEntry]:
    """The tensors a Hugging Face export writes, in file order, from our canonical names to (shape,
    dtype). ``dtype`` converts the storage (None: as they are), except the router weight and expert
    bias, which stay fp32 as transformers keeps them, and integer tables (V4's hash routing). DeepSeek's MTP layers carry copies of the shared
    embedding and head, as in the release."""
    L = config.num_hidden_layers
    entries = []
    for name, (shape, stored) in tensors.items():
        for hf_key, view in hf_keys(name, shape, L, config):
            keep = (hf_key.endswith(("mlp.gate.weight", "e_score_correction_bias", "ffn.gate.weight", "ffn.gate.bias"))
                    or not stored.is_floating_point)   # fp32 routers; integer hash tables
            out_dtype = stored if (dtype is None or keep) else dtype
            numel = view(torch.empty(shape, device="meta")).numel()
            entries.append(ExportEntry(hf_key, name, view, out_dtype, numel * out_dtype.itemsize))
    for k in range(config.num_nextn_predict_layers):
        for hf_key, name in ((f"model.layers.{L + k}.embed_tokens.weight", "embed_tokens.weight"),
                             (f"model.layers.{L + k}.shared_head.head.weight", "lm_head.weight")):
            shape, stored = tensors[name]
            out_dtype = dtype or stored
            entries.append(ExportEntry(hf_key, name, _WHOLE, out_dtype, shape.numel() * out_dtype.itemsize))
    return entries


def shard_entries(entries: list[ExportEntry], max_shard_size: Union[int, str]) -> list[list[ExportEntry]]:
    """``entries`` split into files of at most ``max_shard_size`` bytes (a tensor larger than that gets
    a file of its own), in order."""
    limit = _parse_size(max_shard_size)
    shards: list[list[ExportEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_file_name(i: int, n: int) -> str:
    """The file name of shard ``i`` of ``n``, as transformers names them."""
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index_and_config(directory: Path, shards: list[list[ExportEntry]], hf_cfg: dict) -> None:
    """The index (only when there are several files; a stale one is removed) and ``config.json``."""
    if len(shards) > 1:
        weight_map = {e.hf_key: shard_file_name(i, len(shards)) for i, shard in enumerate(shards) for e in shard}
        total = sum(e.nbytes for shard in shards for e in shard)
        with open(directory / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    elif (directory / INDEX_FILE).exists():
        (directory / INDEX_FILE).unlink()
    with open(directory / CONFIG_FILE, "w") as f:
        json.dump(hf_cfg, f, indent=2)


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------
class _Reader(WeightDirectory):
    """Lazy access to the tensors of a safetensors directory (single file or index); FP8 block-quantized
    weights come dequantized (their ``weight_scale_inv`` are not listed as keys)."""

    def __init__(self, directory: Path):
        try:
            super().__init__(directory)
        except SafetensorsError as err:
            raise HFCheckpointError(str(err)) from None

    def read(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return super().read(*args, **kwargs)
        except SafetensorsError as err:
            raise HFCheckpointError(str(err)) from None


def _ignorable(key: str, config: DeepseekV3Config) -> bool:
    L, D = config.num_hidden_layers, config.num_nextn_predict_layers
    if key.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"^model\.layers\.(\d+)\.", key)
    if m and int(m.group(1)) >= L:
        layer = int(m.group(1))
        # copies of the shared embedding/head, or MTP depths beyond the ones we build
        return layer >= L + D or key.endswith(("embed_tokens.weight", "shared_head.head.weight"))
    return False


def load_pretrained(directory: Union[str, os.PathLike], model_cls: type, device: Union[str, torch.device] = "cpu",
                    **config_overrides: Any) -> torch.nn.Module:
    """Build a ``model_cls`` (``DeepseekV3ForCausalLM``) from a Hugging Face DeepSeek-V3 directory.

    Missing tensors, unexpected tensors, shape mismatches and FP8 weights are errors naming the key.
    ``config_overrides`` set fields of our config (training-side ones such as ``compute_dtype``)."""
    directory = Path(directory)
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.exists():
        raise HFCheckpointError(f"{cfg_path}: not found")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f), **config_overrides)
    reader = _Reader(directory)
    available = reader.keys()

    with torch.device("meta"):
        model = model_cls(config)
    model.to_empty(device=device)
    with torch.no_grad():
        for b in model.buffers():
            b.zero_()

    consumed: set[str] = set()
    missing: list[str] = []
    merged_cache: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in _canonical_tensors(model):
            for hf_key, view in hf_keys(name, param.shape, config.num_hidden_layers, config):
                target = view(param)
                if hf_key in available:
                    src = reader.get(hf_key)
                    consumed.add(hf_key)
                else:
                    src = _from_merged(hf_key, available, reader, merged_cache, consumed)
                    if src is None:
                        missing.append(hf_key)
                        continue
                if src.dtype in FP8_DTYPES:
                    raise HFCheckpointError(f"{hf_key}: {src.dtype} weights without {hf_key}_scale_inv are not "
                                            "supported; dequantize the checkpoint to bf16 first")
                if tuple(src.shape) != tuple(target.shape):
                    raise HFCheckpointError(f"{hf_key}: shape {tuple(src.shape)} in the checkpoint, the model "
                                            f"(config.json) expects {tuple(target.shape)}")
                target.copy_(src)
    if missing:
        raise HFCheckpointError(f"{directory}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:5])}")
    unexpected = sorted(k for k in available - consumed if not _ignorable(k, config))
    if unexpected:
        raise HFCheckpointError(f"{directory}: {len(unexpected)} unexpected tensor(s), e.g. "
                                f"{', '.join(unexpected[:5])}")
    return model


def _from_merged(hf_key: str, available: set[str], reader: _Reader, cache: dict[str, torch.Tensor],
                 consumed: set[str]) -> Optional[torch.Tensor]:
    """One expert's weight out of transformers' merged ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``."""
    parsed = _merged_expert_key(hf_key)
    if parsed is None:
        return None
    merged, j, part = parsed
    if merged not in available:
        return None
    if merged not in cache:
        cache.clear()
        cache[merged] = reader.get(merged)
        consumed.add(merged)
    t = cache[merged][j]
    if part == "down_proj":
        return t
    half = t.shape[0] // 2
    return t[:half] if part == "gate_proj" else t[half:]
