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
    ("train_dataset", "lit_moe.config:TrainDatasetConfig"),
    ("train_dataset.dataloader.config", "lit_moe.data.gpt:GPTDatasetConfig"),
    ("monitor", "lit_moe.config:MonitorConfig"),
    ("profiler", "lit_moe.config:ProfilerConfig"),
    ("context", "lit_moe.config:ContextConfig"),
    ("model", "lit_moe.model.config:DeepseekV3Config"),
]

# Topic pages, in README order.
TOPICS = ["optim.md", "data.md", "parallelism.md", "recompute.md", "checkpoint.md", "evaluation.md", "lora.md",
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


def render() -> str:
    sys.path.insert(0, str(ROOT))
    out = ["## Configuration reference", "",
           "Every key of every section, generated from the config dataclasses (`python docs/make_readme.py`). "
           "Fixed sections reject unknown keys; `model`, `optimizer`, `lr_scheduler` and "
           "`train_dataset.dataloader` accept extra keys, as in MindFormers. The `optimizer` and "
           "`lr_scheduler` keys are listed in their own section below. `trainer:` (any `lightning.Trainer` "
           "argument) is an expert escape hatch; what you set there wins over lit_moe's defaults.", ""]
    for section, path in SECTIONS:
        out += _table(section, _load(path))
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
