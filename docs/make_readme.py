"""Regenerate README.md's reference part from the code: the config dataclasses' field docstrings are the
documentation (litgpt style), and the topic pages in docs/ are folded in after them.

    python docs/make_readme.py        # rewrites README.md below the <!-- SECTIONS --> marker

A test checks that README.md is up to date, so a new config field cannot go undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- SECTIONS -->"

# (YAML section, dataclass import path, source file). Nested dataclasses are expanded as section.sub.
SECTIONS = [
    ("checkpoint", "lit_moe.config:CheckpointConfig"),
    ("training", "lit_moe.config:TrainingConfig"),
    ("parallelism", "lit_moe.config:ParallelismConfig"),
    ("recompute", "lit_moe.config:RecomputeConfig"),
    ("recompute_comm", "lit_moe.config:RecomputeCommConfig"),
    ("swap", "lit_moe.config:SwapConfig"),
    ("train_dataset", "lit_moe.config:TrainDatasetConfig"),
    ("train_dataset.dataloader.config", "lit_moe.data.gpt:GPTDatasetConfig"),
    ("monitor", "lit_moe.config:MonitorConfig"),
    ("profiler", "lit_moe.config:ProfilerConfig"),
    ("context", "lit_moe.config:ContextConfig"),
    ("model", "lit_moe.model.config:DeepseekV3Config"),
]

# Topic pages, in README order.
TOPICS = ["families.md", "optim.md", "data.md", "parallelism.md", "recompute.md", "checkpoint.md", "evaluation.md", "lora.md",
          "callbacks.md"]


def _load(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings: a string literal right after an annotated assignment in the class body."""
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).strip())
        except (OSError, TypeError, IndentationError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                        and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    return f"`{value!r}`" if value is not None else "`null`"


def _table(section: str, cls) -> list[str]:
    docs = _field_docs(cls)
    rows = [f"#### `{section}`", "", "| key | default | meaning |", "|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        default = _default(f)
        if default == "(section)":
            nested.append((f"{section}.{f.name}", type(f.default_factory())))  # type: ignore[misc]
        text = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default} | {text} |")
    rows.append("")
    for sub, sub_cls in nested:
        rows += _table(sub, sub_cls)
    return rows


def _no_effect_table() -> list[str]:
    from lit_moe.config import NO_EFFECT_KEYS

    rows = ["#### Keys accepted without effect", "",
            "MindFormers keys (and Hugging Face `config.json` bookkeeping keys) that load but change nothing "
            "here, and why. This is the one list the code reads (`lit_moe.config.NO_EFFECT_KEYS`).", "",
            "| key | why it has no effect |", "|---|---|"]
    rows += [f"| `{key}` | {why.replace('|', chr(92) + '|')} |" for key, why in NO_EFFECT_KEYS.items()]
    return rows + [""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    out = ["## Configuration reference", "",
           "Every key of every section, generated from the config dataclasses (`python docs/make_readme.py`). "
           "Every key of MindFormers' PyNative config classes loads: it is implemented with MindFormers' "
           "meaning, refused with a one-line \"not implemented yet\" error when its value needs an engine "
           "lit_moe does not have, or listed under [Keys accepted without effect](#keys-accepted-without-effect) "
           "with the reason. Unknown keys are errors with a did-you-mean suggestion, in every section "
           "(`model` takes its fields, their MindFormers / Hugging Face aliases and the keys accepted without "
           "effect; `optimizer`, `lr_scheduler` and `train_dataset.dataloader` are checked by their "
           "consumers). The `optimizer` and `lr_scheduler` keys are listed in their own section below. "
           "`trainer:` (any `lightning.Trainer` argument) is an expert escape hatch; what you set there wins "
           "over lit_moe's defaults.", "",
           "Reading the file: a key given twice in one mapping is an error naming both lines; aliases may not "
           "expand the document beyond a million values (alias bombs are refused at once); the file must be "
           "UTF-8 text in a regular file (a FIFO or device is refused before it is opened). Numbers are read "
           "as YAML 1.2 reads them: `3.76e14`, `1e-5` and `1.e-8` are floats (YAML 1.1 would leave the first "
           "two strings). `--SECTION.KEY VALUE` (for `fit` and `plan`) changes one key at any depth and keeps "
           "its siblings, VALUE read as YAML (`true`, `[0-3]`, `{k: v}`); several "
           "`--config` files merge the same way. An error line cuts a long value to its start and end. "
           "`lit_moe plan` validates the layout with the same function as `fit`, so it refuses what `fit` "
           "refuses. `trainer.fast_dev_run: true` (or N) runs one (N) whole optimizer steps without loggers; "
           "`trainer.strategy` other than lit_moe's, or an accelerator this machine lacks, is one line. "
           "One optimizer step may not take more samples than the train split "
           "(`train_dataset.dataloader.sizes[0]`). `--print_config` prints the resolved configuration (every "
           "fixed section with its defaults, only the `trainer` keys you set): loaded again it is the same "
           "run. Before anything is allocated, `fit` compares each rank's parameters, gradients and optimizer "
           "state with one device's memory (on a CPU: the available RAM shared by this machine's processes) "
           "and refuses, in one line with both numbers and what would make it fit, a model that cannot fit. The "
           "bytes are exactly those of `lit_moe plan`: the local shards of the rank that holds the most under "
           "the run's layout (FSDP/HSDP, tensor, expert and context parallel; with pipeline stages, the "
           "pipeline rank whose stages hold the most), worked out on the meta device, so every rank refuses "
           "together. Activations are not counted.", "",
           "Top-level keys besides the sections: `callbacks` (user callbacks), `gradient_accumulation_steps` "
           "(graph mode's option, translated into `training.global_batch_size`), MindFormers' `lora_config` "
           "(LoRA fine-tuning, see below) and `eval_dataset` (the evaluation data, shaped like `train_dataset`; "
           "see `training.eval_interval`) and "
           "`use_remove_redundant_dataset` (accepted without effect).", ""]
    for section, path in SECTIONS:
        out += _table(section, _load(path))
    out += _no_effect_table()
    for topic in TOPICS:
        page = ROOT / "docs" / topic
        if page.exists():
            text = page.read_text().strip()
            # Each page's top heading becomes a README "##" section (code blocks untouched).
            lines, fenced, headings = text.splitlines(), False, []
            for i, ln in enumerate(lines):
                if ln.startswith("```"):
                    fenced = not fenced
                elif ln.startswith("#") and not fenced:
                    headings.append(i)
            levels = [len(lines[i]) - len(lines[i].lstrip("#")) for i in headings]
            shift = 2 - min(levels) if levels else 0
            for i in headings:
                lines[i] = "#" * shift + lines[i] if shift >= 0 else lines[i][-shift:]
            out += lines + [""]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    readme = ROOT / "README.md"
    head = readme.read_text().split(MARKER)[0]
    readme.write_text(head + MARKER + "\n\n" + render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
