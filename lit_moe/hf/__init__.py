"""Hugging Face interop, in one place: what lit_moe reads from and writes to the Hugging Face ecosystem.

- :mod:`lit_moe.hf.checkpoint`: ``save_pretrained`` / the key map between our tensor names and
  DeepSeek-V3's on-disk ones, ``config.json`` both ways (used by the model, the checkpoint callback's
  export and auto-resume);
- :mod:`lit_moe.hf.families`, :mod:`lit_moe.hf.v4`: the other families' ``config.json`` and names
  (Qwen3-MoE, GLM-4-MoE, DeepSeek-V3.2; DeepSeek-V4);
- :mod:`lit_moe.hf.load`: Hugging Face weights into a built, possibly sharded model (``load_path``);
- :mod:`lit_moe.hf.convert`: ``lit_moe convert-hf``, a trained checkpoint streamed to ``save_pretrained``'s layout;
- :mod:`lit_moe.hf.tokenizer`: a tokenizer directory for ``lit_moe preprocess``.

Its modules sit at different layers of the import graph (``tests/test_import_graph.py``): the key maps
beside the model, the tokenizer beside the data, loading and conversion beside the checkpoints.
"""
