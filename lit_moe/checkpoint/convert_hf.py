"""``lit_moe convert-hf --config pynative.yaml --checkpoint DIR --output DIR``.

Exports a trained checkpoint (a ``save_path``, whose tracker is followed, or one iteration
directory, written by any parallel layout) to the Hugging Face ``save_pretrained`` layout that
``transformers.DeepseekV3ForCausalLM.from_pretrained`` loads. The model is rebuilt from the
config's ``model`` section in one process on the CPU; a config that does not match the checkpoint
fails with the mismatched tensors named. When the config has a ``lora_config``, the checkpoint's
LoRA adapters are merged into the weights (``W + alpha/r · B A``), so the export is a plain model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lit_moe convert-hf",
                                description="Export a lit_moe checkpoint to the Hugging Face layout.")
    p.add_argument("--config", required=True, help="the run's pynative.yaml (its model section is used)")
    p.add_argument("--checkpoint", required=True, help="a save_path (tracker followed) or an iteration directory")
    p.add_argument("--output", required=True, help="directory to write config.json and the safetensors into")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="storage dtype of the weights (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="split the weights into files of at most this size")
    return p


def trained_model(data: dict, config_path: str, checkpoint: str):
    """The model of ``data``'s ``model`` section (one process, CPU) with the weights of ``checkpoint`` (a
    ``save_path`` or an iteration directory written by any layout); LoRA adapters merged."""
    from lit_moe.checkpoint.layout import CheckpointError
    from lit_moe.config import ConfigError
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    model_section = data.get("model")
    if not isinstance(model_section, dict) or not model_section:
        raise ConfigError(f"--config: {config_path!r} has no model section")
    config = DeepseekV3Config(**read_pynative_model_section(model_section))
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"--checkpoint: {str(path)!r} does not exist or is not a directory")
    return model_from_checkpoint(config, data.get("lora_config"), path, f"--config: {config_path!r} has a lora_config")


def model_from_checkpoint(config, lora: Optional[dict], path: Path, lora_origin: str = "lora_config is set"):
    """A ``DeepseekV3ForCausalLM(config)`` on the CPU with the weights of ``path`` (a ``save_path``, its
    tracker followed, or an iteration directory of any layout); ``lora`` adapters merged."""
    import torch

    from lit_moe.checkpoint.iteration import IterationReader, load_module
    from lit_moe.checkpoint.resume import find_iteration_dir
    from lit_moe.config import ConfigError
    from lit_moe.model import DeepseekV3ForCausalLM

    reader = IterationReader(find_iteration_dir(path))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    if lora is not None:
        from lit_moe.lora import apply_lora, is_adapter_name

        if not any(is_adapter_name(k) for k in reader.index("model").keys()):
            raise ConfigError(f"{lora_origin} but {reader.path} holds no LoRA adapters (a base checkpoint); remove "
                              "lora_config to export it as it is")
        apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(0)  # buffers the checkpoint does not hold (non-persistent) get their defined values
    load_module(model, reader)
    if lora is not None:
        from lit_moe.lora import merge_lora

        merge_lora(model)   # the adapters folded into the weights: a plain Hugging Face checkpoint
    return model


def export_atomically(model, output: Path, max_shard_size: str = "5GB", dtype=None) -> None:
    """``save_pretrained`` into a temporary sibling of ``output``, renamed to ``output`` when complete
    (``output``: absent or an empty directory), so a reader never sees a half-written export."""
    import os
    import shutil
    import uuid

    from lit_moe.model.hf import save_pretrained

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_pretrained(model, tmp, max_shard_size=max_shard_size, dtype=dtype)
        if output.is_dir():
            output.rmdir()   # empty (checked before the run); a file there makes the rename fail
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(config_path: str, checkpoint: str, output: str, dtype: Optional[str] = None,
            max_shard_size: str = "5GB") -> Path:
    import torch

    from lit_moe.config_file import load_yaml

    model = trained_model(load_yaml(config_path), config_path, checkpoint)
    out = Path(output)
    export_atomically(model, out, max_shard_size, getattr(torch, DTYPES[dtype]) if dtype else None)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from lit_moe.model.hf import HFCheckpointError
    from lit_moe.config import ConfigError

    try:
        out = convert(args.config, args.checkpoint, args.output, args.dtype, args.max_shard_size)
    except (ConfigError, HFCheckpointError) as err:
        from lit_moe.tool_errors import one_line

        print(f"lit_moe convert-hf: error: {one_line(err)}", file=sys.stderr)
        return 2
    print(f"lit_moe convert-hf: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
