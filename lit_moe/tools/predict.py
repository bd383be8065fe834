"""``lit_moe predict --config pynative.yaml --checkpoint DIR --prompt TEXT [--prompt TEXT ...]``.

Generates text from a trained model in one process (or several, below): the model of the config's
``model`` section with the weights of ``--checkpoint`` (a ``save_path``, an iteration directory
written by any layout, or a Hugging Face ``save_pretrained`` directory), decoding with a cache of the past tokens
(:mod:`lit_moe.model.generate`: MLA's compressed latent, grouped-query attention's keys and values, DeepSeek-V4's
key/values and compressor inputs). Several ``--prompt`` (and/or ``--prompts-file``) form one left-padded batch.
Prints one JSON line per prompt: ``{"prompt", "completion", "tokens"}``.

The tokenizer is the run's: ``--tokenizer`` (``byte``, ``builtin:NAME``, a ``tokenizer.json`` or a
Hugging Face tokenizer directory), else the tokenizer files in the checkpoint directory (MindFormers'
PyNative inference reads weights and tokenizer from ``checkpoint.load_path``), else the built-in
tokenizer of a ``data_path: builtin:NAME`` corpus. Generation stops at its end-of-document token.

MindFormers' ``run_mode: predict`` maps here: such a pynative.yaml is accepted, and its
``checkpoint.load_path`` is the checkpoint when ``--checkpoint`` is not given. Its inference decodes
greedily without the MTP layers, as this does by default (the MTP depths are never run here).

In one process the parallelism section is ignored (a checkpoint of any layout loads whole). Under a
multi-process launcher (``torchrun``, ``WORLD_SIZE`` > 1) it runs the section's ``tensor_parallel``
and ``expert_parallel`` (pipeline or context parallel, and a ``lora_config``, are refused in one line
naming the key): every rank builds the model on the meta device, parallelizes it with the
training's own tensor- and expert-parallel steps (no FSDP: the dense weights are whole on every rank
that is not a tensor-parallel peer), loads its pieces of the checkpoint and generates the same
prompts with the same seeded sampling; rank 0 prints. Tensor parallel keeps the whole sequence on
every rank (:func:`parallelize_for_generation`: plain tensor parallel, no sequence split): each rank
caches the (replicated) latent and expands it into its own heads, or the keys and values of its own
key/value heads.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Optional

from lit_moe.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lit_moe predict", description="Generate text with a trained model.")
    p.add_argument("--config", required=True, help="the run's pynative.yaml (its model section is used)")
    p.add_argument("--checkpoint", default=None,
                   help="a save_path, an iteration directory or a Hugging Face directory "
                        "(default: the config's checkpoint.load_path)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", default=None,
                   help="more prompts: one per non-blank line, or a .jsonl of {\"prompt\": ...} records")
    p.add_argument("--tokenizer", default=None, help="byte, builtin:NAME or a tokenizer path (default: the run's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled distribution (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file: {str(path)!r} does not exist")
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if path.suffix == ".jsonl":
            for n, line in enumerate(lines, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"--prompts-file: {path}:{n}: not JSON ({err.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                    raise ConfigError(f"--prompts-file: {path}:{n}: expected a JSON object with a \"prompt\" string")
                prompts.append(record["prompt"])
        else:
            prompts += lines
    if not prompts:
        raise ConfigError("--prompt: give at least one prompt (--prompt TEXT or --prompts-file FILE)")
    return prompts


def run_tokenizer(spec: Optional[str], checkpoint: Path, data: dict):
    """The tokenizer named by ``spec``, else the run's (see the module docstring)."""
    from lit_moe.data.tokenizer import load_tokenizer

    if spec:
        return load_tokenizer(spec)
    for name in ("tokenizer_config.json", "tokenizer.json"):
        if (checkpoint / name).is_file():
            return load_tokenizer(str(checkpoint))
    loader = ((data.get("train_dataset") or {}).get("dataloader") or {}).get("config") or {}
    paths = loader.get("data_path")
    for p in paths if isinstance(paths, list) else [paths]:
        if isinstance(p, str) and p.startswith("builtin:"):
            return load_tokenizer(p)
    raise ConfigError(f"--tokenizer: {str(checkpoint)!r} holds no tokenizer files and the config's data_path is "
                      "no built-in corpus; name the run's tokenizer (byte, builtin:NAME or a tokenizer path)")


def load_model(data: dict, config_path: str, checkpoint: Path, layout=None, device: str = "cpu"):
    """The config's model with the checkpoint's weights (a Hugging Face directory or ours), on ``device``;
    ``layout(model)`` parallelizes the meta model first (each rank then loads only its pieces)."""
    from lit_moe.hf.convert import trained_model

    if layout is None and not (checkpoint / "config.json").is_file():
        return trained_model(data, config_path, str(checkpoint))
    import torch

    from lit_moe.hf.load import load_hf_into
    from lit_moe.checkpoint.iteration import IterationReader, load_module
    from lit_moe.checkpoint.resume import find_iteration_dir
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**read_pynative_model_section(data["model"])))
    if layout is not None:
        layout(model)
    model.to_empty(device=device)
    model.init_weights(0)   # buffers the checkpoint does not hold get their defined values
    if (checkpoint / "config.json").is_file():
        load_hf_into(model, checkpoint)
    else:
        load_module(model, IterationReader(find_iteration_dir(checkpoint)))
    return model


def parallel_layout(data: dict, config, world_size: int):
    """The ``ParallelDims`` (data-parallel ranks unsharded) and MoE dispatcher of the config's
    tensor/expert parallelism on ``world_size`` ranks, checked before any process group starts."""
    from lit_moe.strategies.expert_parallel import resolve_dispatcher
    from lit_moe.strategies.parallel_dims import ParallelDims

    section = data.get("parallelism") or {}
    for key in ("pipeline_parallel", "context_parallel"):
        if section.get(key, 1) not in (1, None):
            raise ConfigError(f"parallelism.{key}: {section[key]!r}; predict runs tensor_parallel and "
                              "expert_parallel only (set it to 1)")
    if data.get("lora_config"):
        raise ConfigError("lora_config: predict merges LoRA adapters in one process only; launch it without "
                          "torchrun (or export the merged model with convert-hf first)")
    # no FSDP for inference: every data-parallel rank holds the whole dense weights
    dims = ParallelDims(world_size=world_size, tp=section.get("tensor_parallel") or 1,
                        ep=section.get("expert_parallel") or 1)
    dims.validate_model(config)
    dispatcher = resolve_dispatcher(section.get("moe_token_dispatcher_type") or "alltoall",
                                    getattr(config, "moe_token_dispatcher_type", None))
    return dims, dispatcher


def parallelize_for_generation(model, dims, dispatcher: str) -> None:
    """The training's tensor- and expert-parallel steps on the meta model, as plain tensor parallel:
    one new token cannot be split along the sequence (``sequence_parallel=False``: the blocks' entry
    gathers pass their input through, their exit reductions all-reduce, the head's vocabulary columns
    are gathered)."""
    from lit_moe.strategies.parallelize import apply_ep, apply_tp

    apply_tp(model, dims, sequence_parallel=False)
    apply_ep(model, dims, dispatcher, sequence_parallel=False)


def start_processes() -> str:
    """Join the launcher's process group; the device of this rank (its accelerator, else the CPU)."""
    import torch
    import torch.distributed as dist

    from lit_moe.runtime.distributed import release_process_groups_at_exit
    from lit_moe.strategies.accelerators import default_backend

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = f"{accelerator.type}:{int(os.environ.get('LOCAL_RANK', '0'))}" if accelerator else "cpu"
    if accelerator:
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(default_backend(device))
        release_process_groups_at_exit()
    return device


def check_model(config) -> None:
    """What the cached decoder does not implement, refused before anything runs."""
    if config.window_size is not None:
        raise ConfigError(f"model.window_size: {config.window_size!r}: predict has no sliding-window cache")
    if getattr(config, "moe_expert_capacity_factor", None):
        raise ConfigError("model.moe_expert_capacity_factor: token dropping would make a batch's outputs depend on "
                          "its other prompts; predict needs it null")


def predict(args: argparse.Namespace) -> list[dict]:
    from lit_moe.config_file import load_yaml
    from lit_moe.model.generate import generate
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be a positive integer, got {args.max_new_tokens}")
    if not 0.0 < args.top_p <= 1.0:
        raise ConfigError(f"--top-p: must be in (0, 1], got {args.top_p}")
    data = load_yaml(args.config)
    if data.get("run_mode") not in (None, "predict"):
        raise ConfigError(f"run_mode: {data['run_mode']!r}; lit_moe predict reads a pynative.yaml with run_mode "
                          "'predict' or none")
    if not isinstance(data.get("model"), dict) or not data["model"]:
        raise ConfigError(f"--config: {args.config!r} has no model section")
    checkpoint = args.checkpoint or (data.get("checkpoint") or {}).get("load_path")
    if not checkpoint:
        raise ConfigError("--checkpoint: not given, and the config's checkpoint.load_path is empty")
    checkpoint = Path(checkpoint).expanduser()
    if not checkpoint.is_dir():
        raise ConfigError(f"--checkpoint: {str(checkpoint)!r} does not exist or is not a directory")
    config = DeepseekV3Config(**read_pynative_model_section(data["model"]))
    check_model(config)
    layout, device = None, "cpu"
    if world_size > 1:
        dims, dispatcher = parallel_layout(data, config, world_size)
    prompts = read_prompts(args)
    tokenizer = run_tokenizer(args.tokenizer, checkpoint, data)
    encoded = [[int(t) for t in tokenizer.encode(p)] for p in prompts]
    empty = [i for i, ids in enumerate(encoded, 1) if not ids]
    if empty:
        raise ConfigError(f"--prompt: prompt {empty[0]} ({prompts[empty[0] - 1]!r}) is empty after tokenization")
    for i, ids in enumerate(encoded, 1):
        if len(ids) + args.max_new_tokens > config.max_position_embeddings:
            raise ConfigError(f"--prompt: prompt {i} has {len(ids)} tokens; with --max-new-tokens "
                              f"{args.max_new_tokens} that exceeds model.max_position_embeddings "
                              f"{config.max_position_embeddings}")
        if max(ids) >= config.vocab_size:
            raise ConfigError(f"--tokenizer: token id {max(ids)} of prompt {i} is outside model.vocab_size "
                              f"{config.vocab_size} (not the run's tokenizer?)")
    if world_size > 1:
        device = start_processes()
        dims.build_meshes(device.split(":")[0])
        layout = functools.partial(parallelize_for_generation, dims=dims, dispatcher=dispatcher)
    model = load_model(data, args.config, checkpoint, layout, device)
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.eod
    new = generate(model, encoded, args.max_new_tokens, pad_id=pad, eos_id=tokenizer.eod,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return [{"prompt": p, "completion": tokenizer.decode([t for t in toks if t != tokenizer.eod]), "tokens": toks}
            for p, toks in zip(prompts, new)]


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch.distributed as dist

    from lit_moe.hf.checkpoint import HFCheckpointError
    from lit_moe.tools.errors import one_line

    ours = not dist.is_initialized()   # a process group started here (not by a caller) is ended here
    try:
        results = predict(args)
    except (ConfigError, HFCheckpointError) as err:
        print(f"lit_moe predict: error: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        for r in results:
            print(json.dumps(r, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
