"""The DeepSeek-V3 causal LM: embedding → decoder layers (dense, then MoE) → final norm → untied head,
plus optional MTP depths.

Training objective = ``loss + aux_loss + mtp_loss`` where
- ``loss``: masked mean cross-entropy (fp32) of the main head,
- ``aux_loss``: sum over MoE layers of their balancing losses (coefficient included; an MTP layer's
  counts 1/D),
- ``mtp_loss``: ``mtp_loss_scaling_factor / D`` times the sum of the per-depth masked mean CEs,
- ``indexer_loss`` (DeepSeek-V3.2, ``dsa_indexer_loss_coeff > 0``, training forwards): the sum over the
  lightning indexers (MTP layers' included, each weight 1 as in MindFormers) of ``coeff`` times the
  mean over the micro-batch's query tokens of the indexer's KL loss (``lit_moe/model/indexer.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.hf import checkpoint as hf
from lit_moe.model.attention import AttentionContext
from lit_moe.model.compile import compile_enabled, compiled
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.decoder import block_norm
from lit_moe.model.hooks import ModelHooks
from lit_moe.model.hyper_connections import build_collapse, build_decoder_layer, expand_streams
from lit_moe.model.indexer import LightningIndexer, freeze_all_but_indexers
from lit_moe.model.loss import masked_cross_entropy
from lit_moe.model.moe import MoE
from lit_moe.model.mtp import MTPLayer
from lit_moe.model.names import canonical_name
from lit_moe.ops import LayerNorm, Linear, LMHead, RMSNorm


@dataclass
class CausalLMOutput:
    logits: Optional[torch.Tensor]
    """``[B, S, V]`` fp32 logits of the main head; None when the loss came from the fused head (a
    training forward with labels: the logits never exist whole, see ``lit_moe.ops.cross_entropy``)."""
    loss: Optional[torch.Tensor] = None
    """Masked mean cross-entropy (with labels)."""
    aux_loss: Optional[torch.Tensor] = None
    """Sum of the MoE balancing losses, coefficient included (0 when none apply)."""
    mtp_loss: Optional[torch.Tensor] = None
    """lambda / D * sum_k CE_k (with labels; 0 without MTP)."""
    indexer_loss: Optional[torch.Tensor] = None
    """DeepSeek-V3.2: sum over the indexers of their KL losses, coefficient included (a training forward
    with ``dsa_indexer_loss_coeff > 0``; None otherwise). Trains the indexers only."""
    hidden_states: Optional[torch.Tensor] = None
    """The residual after this model's layers when it holds no head (a pipeline stage before the
    last: ``aux_loss`` is then its layers' balancing loss, None when they have none)."""


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 with MLA, MoE (shared + routed experts) and MTP.

    Built eagerly it is initialised with ``init_weights(torch.initial_seed())``; built under
    ``torch.device("meta")`` it stays uninitialised until the caller materialises it
    (``to_empty``) and calls ``init_weights(seed)``, which gives the same values.
    """

    def __init__(self, config: Union[DeepseekV3Config, dict]):
        super().__init__()
        if isinstance(config, dict):
            config = DeepseekV3Config(**config)
        self.config = config
        # what a parallel layout changes in the forward (loss, MTP shift, input sharding, balancing
        # statistics): tensor and context parallelism fill its fields; the MoE layers share it
        self.hooks = ModelHooks()
        c = config
        dtype = c.torch_dtype("params_dtype")
        self.compute_dtype = c.torch_dtype("compute_dtype")
        device = torch.get_default_device()
        with torch.device("meta"):   # allocate once, after construction (no double init)
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.position_embeddings = (nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype)
                                        if c.position_embedding_type == "learned_absolute" else None)
            self.layers = nn.ModuleList(build_decoder_layer(c, i, dtype=dtype) for i in range(c.num_hidden_layers))
            # mHC: the final streams collapse into one ahead of the norm
            self.hc_head = build_collapse(c) if c.enable_hyper_connections else None
            self.norm = block_norm(c, c.hidden_size, dtype)
            self.lm_head = LMHead(c.hidden_size, c.vocab_size, dtype=dtype)
            self.mtp = nn.ModuleList(MTPLayer(c, c.num_hidden_layers + k, dtype=dtype)
                                     for k in range(c.num_nextn_predict_layers))
        # kept as plain lists: the MoE objects survive wrapping (checkpoint, FSDP, compile)
        self._main_moe = [m for layer in self.layers for m in layer.modules() if isinstance(m, MoE)]
        self._mtp_moe = [m for mtp in self.mtp for m in mtp.modules() if isinstance(m, MoE)]
        self._indexers = [m for m in self.modules() if isinstance(m, LightningIndexer)]   # MTP layers' too
        if c.sparse_attention and not c.dsa_indexer_use_sparse_loss:   # DeepSeek-V3.2's dense warm-up stage
            freeze_all_but_indexers(self)
        for part in self.modules():   # every part with hooks (blocks, MoE layers, indexers) shares the model's
            if isinstance(getattr(part, "hooks", None), ModelHooks):
                part.hooks = self.hooks
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights(torch.initial_seed())

    # ------------------------------------------------------------------ structure
    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers this model holds, in order (a pipeline stage's ``layers`` is a
        ``ModuleDict`` of its own, keyed by their global index)."""
        return list(self.layers.values()) if isinstance(self.layers, nn.ModuleDict) else list(self.layers)

    def blocks(self) -> list[nn.Module]:
        """Decoder layers, then the MTP layers' decoder layers (ids 0..total_layers-1)."""
        return [*self.decoder_layers(), *(m.layer for m in self.mtp)]

    def moe_layers(self) -> list[MoE]:
        """Every MoE module, in block order."""
        return [*self._main_moe, *self._mtp_moe]

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """N(0, initializer_range) for linear, embedding, router and expert weights; norms 1/0, linear biases 0;
        buffers (expert bias, counters) 0. Each parameter draws from its own generator seeded by
        ``(seed, name)``, so values do not depend on sharding, device or construction order. For a
        DTensor the full tensor is generated and the local shard kept."""
        seed = torch.initial_seed() if seed is None else int(seed)
        std = self.config.initializer_range
        for mod_name, mod in self.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if isinstance(mod, (RMSNorm, LayerNorm)):
                    p.fill_(1.0 if pname == "weight" else 0.0)
                    continue
                if pname == "bias" and isinstance(mod, Linear):   # GQA's q/k/v biases start at 0
                    p.zero_()
                    continue
                name = canonical_name(f"{mod_name}.{pname}" if mod_name else pname)
                _normal_by_name(p, std, _param_seed(seed, name))
            for _, b in mod.named_buffers(recurse=False):
                b.zero_()
        for mod in self.modules():   # starts that are not N(0, std): mHC gates, hash tables, sinks
            if hasattr(mod, "init_extra"):
                mod.init_extra()

    # ------------------------------------------------------------------ expert bias
    @torch.no_grad()
    def update_expert_bias(self, counts: Optional[torch.Tensor] = None) -> None:
        """``b += moe_router_bias_update_rate * sign(mean(c) - c)`` per MoE layer, then zero the counters.

        ``counts [n_moe_layers, E]``: tokens per expert summed over the step's micro-batches and the
        data-parallel ranks (the caller all-reduces; tensor/context/expert-parallel ranks of one
        data-parallel rank route the same tokens); None: this process's counters."""
        layers = self.moe_layers()
        if not layers:
            return
        if counts is None:
            counts = torch.stack([m.tokens_per_expert for m in layers])
        if counts.shape[0] != len(layers):
            raise ValueError(f"update_expert_bias: counts has {counts.shape[0]} rows, the model has "
                             f"{len(layers)} MoE layers")
        rate = self.config.moe_router_bias_update_rate
        for moe, c in zip(layers, counts):
            if self.config.moe_router_enable_expert_bias and rate > 0 and moe.router.has_expert_bias:
                bias = moe.router.expert_bias
                c = c.to(device=bias.device, dtype=torch.float32)
                bias += rate * torch.sign(c.mean() - c)
            moe.tokens_per_expert.zero_()

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.position_embeddings is not None:
            h = h + self.position_embeddings(position_ids)
        return F.dropout(h.to(self.compute_dtype), self.config.hidden_dropout, self.training)

    def streams_in(self, h: torch.Tensor) -> torch.Tensor:
        """The residual the decoder layers carry: ``h [B, S, H]`` itself, or with mHC its
        ``hc_mult`` copies ``[B, S, n, H]`` (what a pipeline stage boundary then carries too)."""
        return expand_streams(h, self.config.hc_mult) if self.config.enable_hyper_connections else h

    def streams_out(self, h: torch.Tensor) -> torch.Tensor:
        """The residual after the last layer back to ``[B, S, H]`` (mHC: ``hc_head``'s collapse)."""
        return self.hc_head(h) if self.hc_head is not None else h

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                actual_seq_len: Optional[torch.Tensor] = None,
                hidden_states: Optional[torch.Tensor] = None) -> CausalLMOutput:
        """Embedding → decoder layers → (mHC collapse) → final norm and head → MTP depths.

        A model may hold part of itself (a pipeline stage, as TorchTitan's models do): given
        ``hidden_states`` (the previous part's residual, ``[B, S, H]`` or mHC's ``[B, S, n, H]``) it
        starts there instead of embedding ``input_ids`` (which every part still receives: positions,
        masks, MTP); it runs the decoder layers it holds (:meth:`decoder_layers`); without
        ``lm_head`` it stops after them and returns ``hidden_states`` and their balancing (and indexer) losses."""
        input_ids, labels, loss_mask, position_ids, ctx = self._inputs(
            input_ids, labels, loss_mask, position_ids, attention_mask, actual_seq_len)
        if hidden_states is None:
            if self.embed_tokens is None:
                raise ValueError("this part of the model holds no embedding: pass the previous part's hidden_states")
            hidden_states = self.streams_in(self.embed(input_ids, position_ids))
        h = hidden_states
        for layer in self.decoder_layers():
            h = layer(h, ctx)
        if self.lm_head is None:   # a part before the head: its residual goes on to the next part
            return CausalLMOutput(logits=None, hidden_states=h, aux_loss=self._take_aux(self._main_moe),
                                  indexer_loss=self._take_indexer_loss())
        h = self.streams_out(h)
        mask = None
        if labels is not None:
            mask = labels != -100
            if loss_mask is not None:
                mask = mask & (loss_mask != 0)
        if labels is not None and self._fused_loss():
            h, loss = self._maybe_compiled(DeepseekV3ForCausalLM._fused_head)(self, h, labels, mask)
            logits = None
        else:
            h, logits, loss = self._maybe_compiled(DeepseekV3ForCausalLM._head)(self, h, labels, mask)
        out = CausalLMOutput(logits=logits, loss=loss)
        aux = self._take_aux(self._main_moe)

        if labels is not None:
            out.mtp_loss = out.loss.new_zeros(())
            if len(self.mtp):
                out.mtp_loss = self._mtp_forward(h, input_ids, labels, mask, position_ids, ctx)
                mtp_aux = self._take_aux(self._mtp_moe)
                if mtp_aux is not None:
                    mtp_aux = mtp_aux / len(self.mtp)
                    aux = mtp_aux if aux is None else aux + mtp_aux
        out.aux_loss = aux if aux is not None else h.new_zeros((), dtype=torch.float32)
        out.indexer_loss = self._take_indexer_loss()
        return out

    def _inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor], loss_mask: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                actual_seq_len: Optional[torch.Tensor]):
        """This rank's ``(input_ids, labels, loss_mask, position_ids [B, S], attention context)``: the
        inputs sharded by ``hooks.shard_inputs`` (context parallel, whose masks of the whole sequence
        ride in the context), positions ``arange(S)`` when absent."""
        cp_masks = None
        if self.hooks.shard_inputs is not None:
            call, cp_masks = self.hooks.shard_inputs(dict(
                input_ids=input_ids, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                attention_mask=attention_mask, actual_seq_len=actual_seq_len))
            input_ids, labels, loss_mask = call["input_ids"], call.get("labels"), call.get("loss_mask")
            position_ids, attention_mask, actual_seq_len = call["position_ids"], None, None
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)
        position_ids = position_ids.to(device=input_ids.device, dtype=torch.long).expand(B, S)
        ctx = AttentionContext.build(self.config, position_ids, attention_mask, actual_seq_len, input_ids)
        if cp_masks is not None:
            ctx.full_mask = ctx.window_mask = cp_masks
        return input_ids, labels, loss_mask, position_ids, ctx

    def _mtp_forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                     mask: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Depth k: inputs, labels, mask and positions shifted left by k (zero-filled)."""
        total = hidden.new_zeros((), dtype=torch.float32)
        ids, lab, msk, pos = input_ids, labels, mask, position_ids
        for layer in self.mtp:
            ids, lab, msk, pos = (self.hooks.shift_left(t) for t in (ids, lab, msk, pos))
            hidden = layer(hidden, self.embed(ids, pos), ctx.with_positions(self.config, pos))
            if self._fused_loss():
                total = total + self._maybe_compiled(DeepseekV3ForCausalLM._mtp_fused_loss)(self, hidden, lab, msk)
            else:
                total = total + self._maybe_compiled(DeepseekV3ForCausalLM._mtp_loss)(self, hidden, lab, msk)
        return total * (self.config.mtp_loss_scaling_factor / len(self.mtp))

    def _head(self, h: torch.Tensor, labels: Optional[torch.Tensor], mask: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Final norm, fp32 logits and (with labels) the loss: (normed h, logits, loss)."""
        h = self.norm(h)
        logits = self.lm_head(h).float()
        loss = self._loss(logits, labels, mask) if labels is not None else None
        return h, logits, loss

    def _fused_head(self, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and the fused linear + cross-entropy (training): (normed h, loss)."""
        h = self.norm(h)
        return h, self._shared(self.lm_head(h, labels, mask), mask)

    def _mtp_fused_loss(self, hidden: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._shared(self.lm_head(hidden, labels, mask), mask)

    def _mtp_loss(self, hidden: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._loss(self.lm_head(hidden).float(), labels, mask)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The masked mean cross-entropy of ``logits`` (per token as ``hooks.per_token_loss`` says), as
        this rank reports it (``hooks.loss_share``)."""
        per_token = self.hooks.per_token_loss
        loss = (masked_cross_entropy(logits, labels, mask) if per_token is None
                else masked_cross_entropy(logits, labels, mask, per_token=per_token))
        return self._shared(loss, mask)

    def _shared(self, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        share = self.hooks.loss_share
        return loss if share is None else share(loss, mask)

    def _fused_loss(self) -> bool:
        # Only for gradients (it computes them in forward) and the local cross-entropy: tensor
        # parallel's vocabulary-parallel one runs over sharded logits.
        return torch.is_grad_enabled() and self.hooks.per_token_loss is None

    def _maybe_compiled(self, fn):
        # The head's loss is only compiled in its default form: tensor parallel's vocabulary-parallel
        # loss and context parallel's share have collectives inside. Not when norm and head are an FSDP unit
        # (several ranks): its hooks would break the graph (the fused loss is lean eagerly).
        # (Training forwards of that default form compile the fused head, the others the plain
        # norm + head + loss.)
        if (compile_enabled(self.config.torch_compile, self.lm_head.weight.device)
                and self.hooks.plain_loss() and not any(map(self.hooks.breaks_graphs, (self.norm, self.lm_head)))):
            return compiled(fn)
        return fn

    def _take_indexer_loss(self) -> Optional[torch.Tensor]:
        terms = [m.loss for m in self._indexers if m.loss is not None]
        for m in self._indexers:
            m.loss = None
        return torch.stack(terms).sum() if terms else None

    @staticmethod
    def _take_aux(moes: list[MoE]) -> Optional[torch.Tensor]:
        terms = [m.aux_loss for m in moes if m.aux_loss is not None]
        for m in moes:
            m.aux_loss = None
        return torch.stack(terms).sum() if terms else None

    # ------------------------------------------------------------------ Hugging Face interop
    def save_pretrained(self, directory, max_shard_size: Union[int, str] = "5GB",
                        dtype: Optional[torch.dtype] = None) -> None:
        """Write ``config.json`` + safetensors in the Hugging Face DeepSeek-V3 layout."""
        hf.save_pretrained(self, directory, max_shard_size=max_shard_size, dtype=dtype)

    @classmethod
    def from_pretrained(cls, directory, device: Union[str, torch.device] = "cpu",
                        **config_overrides) -> "DeepseekV3ForCausalLM":
        """Load a Hugging Face DeepSeek-V3 directory (ours or a real one); ``config_overrides`` set
        training-side fields (e.g. ``compute_dtype``, ``moe_aux_loss_coeff``)."""
        return hf.load_pretrained(directory, cls, device=device, **config_overrides)


def _normal_by_name(p: torch.Tensor, std: float, seed: int) -> None:
    """Fill ``p`` with N(0, std) drawn by a CPU generator seeded with ``seed`` (full tensor for DTensors)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    full = torch.empty(p.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)
    if hasattr(p, "device_mesh"):   # DTensor: keep this rank's shard of the full tensor
        from torch.distributed.tensor import distribute_tensor
        local = distribute_tensor(full.to(p.to_local().device), p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)


__all__ = ["CausalLMOutput", "DeepseekV3ForCausalLM"]
