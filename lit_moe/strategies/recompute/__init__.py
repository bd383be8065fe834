"""Activation recompute (``recompute``) and communication recompute (``recompute_comm``).

Three ways a part of a decoder layer can trade compute for memory, all applied by forward hooks on
the selected modules (no ``forward`` is replaced, no module is wrapped), so that parameter names
(FQNs) never change (checkpoints and the Hugging Face export rely on them):

* **whole layer** (``recompute.full_recompute_layer``): the layer's call runs under
  non-reentrant activation checkpointing. Only the layer's inputs are kept; everything inside is
  recomputed in backward.
* **selected module** (``recompute.select_module``, a module path such as ``self_attention``): the
  same, for one sub-module.
* **output recompute** (``recompute.select_module`` matching a communication step such as
  ``mlp.router.all_gather``, and every path of ``recompute_comm.select_module``): the call runs
  normally, but its *output* is not kept for backward. An op that saves the output (or a view of
  it) saves a small handle instead, and backward re-runs the call from its (kept) inputs when it
  needs the value. This is what "recompute a communication step" means: e.g. the sequence
  all-gather in front of a tensor-parallel matmul is re-done in backward instead of holding the
  gathered activation from forward to backward.

Layer ids address ``model.blocks()``: decoder layers ``0..L-1``, then the MTP layers' decoder
layers ``L..L+M-1``. Paths are dotted module paths inside one such layer (``self_attention``,
``self_attention.q_b_proj``, ``mlp.experts``) or a module path plus the name of a communication step
the parallel steps set on it (``mlp.router.all_gather``, a :class:`~lit_moe.strategies.comm.CommStep`,
whose ``recompute`` slot output recompute fills). A regex must match a path fully (``re.fullmatch``).

Order of application (TorchTitan): tensor/expert/context parallel first (so that their
communication functions exist and can be matched), then this, then FSDP. Forward hooks a selected
module already has (the parallel steps': parameter shards, sequence gathers) are inside the
recomputed region and re-run with it; FSDP's hooks, added later, stay outside (they gather the
parameters before the recompute in backward). FSDP asks the returned :class:`RecomputePlan` which
layers re-gather their parameters (:func:`fsdp_reshard_after_forward`); nothing is left on the modules.
Unlike MindFormers, which ignores these sections on one device, recompute works on one device.

The package: :mod:`.plan` (the sections validated into a :class:`RecomputePlan`), :mod:`.paths`
(what a layer's paths are and how patterns match them), :mod:`.hooks` (the forward-hook region around
a module's call, what a re-run runs, and activation checkpointing), :mod:`.saved_tensors` (the saved-tensor engine of
output recompute) and :mod:`.apply` (putting a plan on a model and taking it off).
"""

from lit_moe.strategies.recompute.apply import apply_recompute, fsdp_reshard_after_forward, remove_recompute
from lit_moe.strategies.recompute.hooks import regions
from lit_moe.strategies.recompute.paths import addressable_paths
from lit_moe.strategies.recompute.plan import FSDP_ALL_GATHER, RecomputePlan, RecomputeWarning, validate_recompute

__all__ = [
    "FSDP_ALL_GATHER", "RecomputePlan", "RecomputeWarning", "addressable_paths", "apply_recompute",
    "fsdp_reshard_after_forward", "regions", "remove_recompute", "validate_recompute",
]
