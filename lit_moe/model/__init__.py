"""The DeepSeek-V3 MoE model (see docs/design.md, "Model contract")."""

from lit_moe.model.attention import AttentionContext, CoreAttention, MLAttention
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.moe import MLP, GroupedExperts, MoE, Router
from lit_moe.model.mtp import MTPLayer
from lit_moe.model.sizing import ParamCounts, flops_per_token, param_counts
from lit_moe.model.decoder import DecoderLayer
from lit_moe.model.transformer import CausalLMOutput, DeepseekV3ForCausalLM

__all__ = [
    "AttentionContext", "CausalLMOutput", "CoreAttention", "DecoderLayer", "DeepseekV3Config",
    "DeepseekV3ForCausalLM", "GroupedExperts", "MLAttention", "MLP", "MTPLayer", "MoE", "ParamCounts",
    "Router", "flops_per_token", "param_counts",
]
