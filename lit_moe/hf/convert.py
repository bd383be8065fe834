"""``lit_moe convert-hf --config pynative.yaml --checkpoint DIR --output DIR``.

Exports a trained checkpoint (a ``save_path``, whose tracker is followed, or one iteration
directory, written by any parallel layout) to the Hugging Face ``save_pretrained`` layout that
``transformers.DeepseekV3ForCausalLM.from_pretrained`` loads. The model's tensor shapes come from the
config's ``model`` section (built on the meta device); a config that does not match the checkpoint
fails with the mismatched tensors named.

The export streams, one Hugging Face tensor at a time: the region of our tensor it comes from is read
by byte range from the checkpoint (its index), converted, and appended to a safetensors file whose
header was written first (every shape and dtype is known in advance). Memory stays at about the
largest single Hugging Face tensor (an embedding, one expert's matrix), not the model (2.7 TB in fp32
for DeepSeek-V3). When the config has a ``lora_config``, the checkpoint's LoRA adapters are merged
into the weights (``W + alpha/r · B A``), so the export is a plain model; that path builds the whole
model in memory.
"""

from __future__ import annotations

import argparse
import math
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


def _config_and_checkpoint(data: dict, config_path: str, checkpoint: str):
    """(model config of ``data``'s ``model`` section, checkpoint directory), each checked."""
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
    return config, path


def trained_model(data: dict, config_path: str, checkpoint: str):
    """The model of ``data``'s ``model`` section (one process, CPU) with the weights of ``checkpoint`` (a
    ``save_path`` or an iteration directory written by any layout); LoRA adapters merged."""
    config, path = _config_and_checkpoint(data, config_path, checkpoint)
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


def write_atomically(output: Path, write) -> None:
    """``write(tmp)`` into a temporary sibling of ``output``, renamed to ``output`` when complete
    (``output``: absent or an empty directory), so a reader never sees a half-written export."""
    import os
    import shutil
    import uuid

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        if output.is_dir():
            output.rmdir()   # empty (checked before the run); a file there makes the rename fail
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_atomically(model, output: Path, max_shard_size: str = "5GB", dtype=None) -> None:
    """``save_pretrained`` of a model in memory, written atomically (:func:`write_atomically`)."""
    from lit_moe.hf.checkpoint import save_pretrained

    write_atomically(output, lambda tmp: save_pretrained(model, tmp, max_shard_size=max_shard_size, dtype=dtype))


def convert(config_path: str, checkpoint: str, output: str, dtype: Optional[str] = None,
            max_shard_size: str = "5GB") -> Path:
    """The export of ``lit_moe convert-hf``: streamed tensor by tensor (:func:`stream_export`), or through a
    whole model in memory when LoRA adapters are merged."""
    import torch

    from lit_moe.checkpoint.iteration import IterationReader
    from lit_moe.checkpoint.resume import find_iteration_dir
    from lit_moe.config_file import load_yaml
    from lit_moe.model import DeepseekV3ForCausalLM

    data = load_yaml(config_path)
    out = Path(output)
    out_dtype = getattr(torch, DTYPES[dtype]) if dtype else None
    if data.get("lora_config") is not None:
        model = trained_model(data, config_path, checkpoint)
        export_atomically(model, out, max_shard_size, out_dtype)
        return out
    config, path = _config_and_checkpoint(data, config_path, checkpoint)
    reader = IterationReader(find_iteration_dir(path))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    write_atomically(out, lambda tmp: stream_export(model, reader, tmp, out_dtype, max_shard_size))
    return out


def stream_export(model, reader, out: Path, dtype, max_shard_size: str) -> Path:
    """Write the Hugging Face directory of ``model`` (on the meta device: names, shapes, dtypes) from the
    checkpoint ``reader``, one tensor at a time (see the module docstring)."""
    import torch

    from lit_moe.hf.load import region, view_geometry
    from lit_moe.checkpoint.iteration import _prefix_map, _SubIndex
    from lit_moe.checkpoint.sharded import Piece, canonical, check_shapes
    from lit_moe.hf import checkpoint as hf

    config = model.config
    index = reader.index("model")
    shapes = {canonical(k): v for k, v in model.state_dict().items()}
    mapping = _prefix_map(list(shapes), index.keys(), reader.path)
    prefix = next((s_[: len(s_) - len(k)] for k, s_ in mapping.items()), "")

    class _Shape:
        def __init__(self, shape):
            self.global_shape = tuple(shape)

    check_shapes(_SubIndex(index, {k for k in index.keys() if k.startswith(prefix)}),
                 {mapping[k]: _Shape(v.shape) for k, v in shapes.items()}, "the model weights", reader.path)

    shards = hf.shard_entries(hf.export_entries({k: (t.shape, t.dtype) for k, t in shapes.items()}, config, dtype),
                              max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(shards):
        geometry = {e.hf_key: view_geometry(e.view, tuple(shapes[e.name].shape)) for e in shard}
        with SafetensorsWriter(out / hf.shard_file_name(i, len(shards)),
                               [(e.hf_key, e.dtype, geometry[e.hf_key].shape) for e in shard]) as w:
            for e in shard:
                geo = geometry[e.hf_key]
                full = [geo.start[b] if b is not None else 0 for b in range(len(geo.start))]
                sizes = [1] * len(geo.start)
                for d, b in enumerate(geo.dims):
                    if b is not None:
                        sizes[b] = geo.shape[d]
                buf = torch.empty(sizes, dtype=shapes[e.name].dtype)   # our tensor's region that makes this HF tensor
                index.read([(mapping[e.name], buf, tuple(full), 0)])
                _, hf_view = region(geo, Piece(buf, tuple(full), ()))
                w.append(e.hf_key, hf_view.to(e.dtype))
    hf.write_index_and_config(out, shards, hf.hf_config_dict(config, dtype))
    return out


class SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (every key's dtype, shape and byte
    range, in the order given) first, then each tensor's bytes as it is appended."""

    def __init__(self, path: Path, layout: list) -> None:
        import json

        from lit_moe.model.safetensors_io import DTYPES

        names = {v: k for k, v in DTYPES.items()}
        header, offset = {}, 0
        self.order = []
        for key, dtype, shape in layout:
            n = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            self.order.append((key, dtype, tuple(shape)))
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)   # data aligned to 8 bytes, as safetensors writes it
        self.f = open(path, "wb")
        self.f.write(len(text).to_bytes(8, "little") + text)
        self.next = 0

    def append(self, key: str, t) -> None:
        want = self.order[self.next]
        if (key, t.dtype, tuple(t.shape)) != want:
            raise ValueError(f"safetensors writer: got {key} {t.dtype} {list(t.shape)}, expected {want}")
        import torch

        self.f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.next += 1

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()
        if exc[0] is None and self.next != len(self.order):
            raise ValueError(f"safetensors writer: {len(self.order) - self.next} tensor(s) never written")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from lit_moe.hf.checkpoint import HFCheckpointError
    from lit_moe.config import ConfigError

    try:
        out = convert(args.config, args.checkpoint, args.output, args.dtype, args.max_shard_size)
    except (ConfigError, HFCheckpointError) as err:
        from lit_moe.tools.errors import one_line

        print(f"lit_moe convert-hf: error: {one_line(err)}", file=sys.stderr)
        return 2
    print(f"lit_moe convert-hf: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
