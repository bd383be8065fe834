"""The package's import graph: no circles, and nothing imported upward.

Read from the source with ``ast`` (function-level imports included: a lazy import is still a
dependency), so the check needs no imports and takes milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module may import only modules of its own layer or below; within one layer the
# graph must still have no cycle.
LAYERS = [
    ["lit_moe", "lit_moe.config", "lit_moe.config_file", "lit_moe.step", "lit_moe.runtime",
     "lit_moe.tools.errors"],
    ["lit_moe.ops"],
    # the Hugging Face interop is one package whose modules sit beside what they serve: the key maps
    # beside the model, the tokenizer beside the data, loading and conversion beside the checkpoints
    ["lit_moe.model", "lit_moe.hf", "lit_moe.hf.checkpoint", "lit_moe.hf.families", "lit_moe.hf.v4"],
    ["lit_moe.data", "lit_moe.optim", "lit_moe.lora", "lit_moe.hf.tokenizer"],
    ["lit_moe.checkpoint", "lit_moe.hf.load", "lit_moe.hf.convert"],
    ["lit_moe.strategies"],
    # the pipeline builds its stages with the strategies' parallelisms; the strategy, and the plans
    # that print per pipeline rank, use it
    ["lit_moe.pipeline"],
    ["lit_moe.strategies.strategy", "lit_moe.strategies.plan", "lit_moe.strategies.memory_plan"],
    ["lit_moe.callbacks"],
    ["lit_moe.tools", "lit_moe.name_keys"],
    ["lit_moe.module"],
    ["lit_moe.cli"],
]


def modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "lit_moe").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:  # ``from pkg import submodule`` depends on the submodule
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in mods else target)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def layer_of(module: str) -> int:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or (prefix != "lit_moe" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_correctly():
    graph = import_graph()
    # known edges, one per import form: plain, from-module, from-package-submodule, function-level
    assert "lit_moe.step" in graph["lit_moe.module"]
    assert "lit_moe.hf.checkpoint" in graph["lit_moe.model.transformer"]
    assert "lit_moe.checkpoint.safejson" in graph["lit_moe.checkpoint.callback"]
    assert "lit_moe.optim.optimizers" in graph["lit_moe.strategies.plan"]        # imported inside a function
    # the checker itself finds a planted cycle and a planted upward import
    planted = {**graph, "lit_moe.model.moe": graph["lit_moe.model.moe"] | {"lit_moe.model.transformer"}}
    assert any("lit_moe.model.moe" in c for c in cycles(planted))
    assert layer_of("lit_moe.model.moe") < layer_of("lit_moe.checkpoint.iteration")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("lit_moe.brand_new_module")


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_nothing_is_imported_upward():
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                    if layer_of(d) > layer_of(m))
    assert upward == []


def test_the_step_contract_is_a_leaf():
    graph = import_graph()
    for leaf in ("lit_moe.step", "lit_moe.runtime.distributed", "lit_moe.model.names", "lit_moe.model.loss"):
        assert graph[leaf] == set(), (leaf, graph[leaf])


# ----------------------------------------------------------------------------------------------
# no rebinding: a parallelism fills the model's hooks (lit_moe.model.hooks.ModelHooks), it does not
# assign the model's attributes, and FSDP asks the recompute plan instead of reading flags
# ----------------------------------------------------------------------------------------------
# what parallelisms used to assign on the model and its modules, the markers they left on swapped
# functions, and the flag recompute left for FSDP: none may be assigned, read or named in lit_moe,
# except the two that are ModelHooks fields now, on a ``hooks`` object
REBOUND = {"loss_function", "shift_left", "context_parallel_inputs", "context_parallel_shard", "aux_stats_reduce",
           "gather_vocab", "__wrapped__", "shard_loss_of", "_lit_moe_reshard_after_forward"}
HOOK_FIELDS = {"shift_left", "aux_stats_reduce"}
# the parallelisms, where no ``setattr`` may put anything on a module either
PARALLELISMS = ("lit_moe/strategies/", "lit_moe/tools/predict.py")
# a module a parallelism must not replace (context parallel fills the core attention's
# ``context_parallel`` slot): assigned only in an ``__init__``
REPLACED = {"core_attention"}


def _on_hooks(node: ast.Attribute) -> bool:
    owner = node.value
    return node.attr in HOOK_FIELDS and ((isinstance(owner, ast.Name) and owner.id == "hooks")
                                         or (isinstance(owner, ast.Attribute) and owner.attr == "hooks"))


def rebindings(source: str, parallelism: bool = True) -> list[str]:
    """``line: what`` for each assignment to a ``.forward`` or a :data:`REBOUND` attribute (not a
    ``hooks`` field), or to a :data:`REPLACED` module outside an ``__init__``, each string naming
    one of the others, and in a ``parallelism`` each ``setattr`` / ``__setattr__`` call."""
    found, assigned = [], set()
    tree = ast.parse(source)
    in_init = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
               for n in ast.walk(f)}
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and t.attr in REPLACED and id(t) not in in_init:
                    found.append(f"{node.lineno}: .{t.attr} =")
                if isinstance(t, ast.Attribute) and (t.attr == "forward" or t.attr in REBOUND):
                    assigned.add(id(t))
                    if not _on_hooks(t):
                        found.append(f"{node.lineno}: .{t.attr} =")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if parallelism and name in ("setattr", "__setattr__"):
                found.append(f"{node.lineno}: {name}(")
        if (isinstance(node, ast.Attribute) and node.attr in REBOUND and id(node) not in assigned
                and not _on_hooks(node)):
            found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Constant) and node.value in REBOUND - HOOK_FIELDS:
            found.append(f"{node.lineno}: {node.value!r}")
    return sorted(set(found))


def test_the_rebinding_check_sees_each_form():
    planted = ("model.loss_function = f\nblock.forward = w\nsetattr(m, 'x', 1)\nobject.__setattr__(m, 'y', 2)\n"
               "getattr(model, 'context_parallel_inputs', None)\nmoe.aux_stats_reduce(c)\na, m.shift_left = 1, g\n"
               "attn.core_attention = Wrapper(attn.core_attention)\n"
               "class A:\n    def __init__(self):\n        self.core_attention = CoreAttention()\n")
    assert rebindings(planted) == ["1: .loss_function =", "2: .forward =", "3: setattr(", "4: __setattr__(",
                                   "5: 'context_parallel_inputs'", "6: .aux_stats_reduce", "7: .shift_left =",
                                   "8: .core_attention ="]
    assert rebindings("model.hooks.loss_share = share\nself.hooks = ModelHooks()\nhooks.shift_left = f\n"
                      "self.hooks.aux_stats_reduce(c)\n__all__ = ['shift_left']\n") == []
    assert rebindings("setattr(m, 'x', 1)\n", parallelism=False) == []


def test_no_parallelism_rebinds_the_model():
    found = {}
    for path in sorted((ROOT / "lit_moe").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        hits = rebindings(path.read_text(), parallelism=name.startswith(PARALLELISMS))
        if hits:
            found[name] = hits
    # recompute and the parallel steps work by forward hooks and slots (output recompute of a
    # communication step fills its CommStep's ``recompute``): no setattr, nothing assigns ``.forward``
    assert found == {}, found
    # a pipeline stage shares the model's hooks object, it does not copy the model's attributes, and
    # it runs the model's own forward (no head, MTP or embedding code of its own)
    stage = (ROOT / "lit_moe/pipeline/stage.py").read_text()
    assert not [word for word in ("vars(model)", "_head(", "_mtp_forward(", ".embed(", "streams_in(") if word in stage]


def test_the_model_does_not_import_fsdp():
    """Compiling around FSDP2 units is a step of ``parallelize`` (``apply_compile``)."""
    for path in sorted((ROOT / "lit_moe" / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any("fsdp" in n for n in names), (path.name, node.lineno, names)


def test_the_top_level_shows_the_architecture():
    """At most eight modules directly in ``lit_moe/``: everything else lives in the package of its
    concept (model, ops, data, optim, runtime, checkpoint, strategies, callbacks, tools)."""
    top = sorted(p.name for p in (ROOT / "lit_moe").glob("*.py"))
    assert len(top) <= 8, top


# ----------------------------------------------------------------------------------------------
# the pipeline behind the strategy interface: only the strategy package (and the pipeline's own)
# knows that a rank may hold part of the model; the module, the callbacks and the checkpoint code
# ask lit_moe.step.StepStrategy
# ----------------------------------------------------------------------------------------------
PIPELINE_HOME = ("lit_moe/strategies/", "lit_moe/pipeline/")
PROBED = {"pipeline", "holds_part_of_model"}


def _names_strategy(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "strategy" in name.lower()


def pipeline_probes(source: str) -> list[str]:
    """``line: what`` for each ``<strategy>.pipeline``, ``getattr``/``hasattr`` of ``pipeline`` or
    ``holds_part_of_model``, and any other mention of ``holds_part_of_model``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr == "holds_part_of_model"
                                                or (node.attr == "pipeline" and _names_strategy(node.value))):
            found.append(f"{node.lineno}: .{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PROBED):
            found.append(f"{node.lineno}: {node.func.id}({node.args[1].value!r})")
        if isinstance(node, ast.Constant) and node.value == "holds_part_of_model":
            found.append(f"{node.lineno}: 'holds_part_of_model'")
    return sorted(set(found))


def test_the_pipeline_probe_check_sees_each_form():
    planted = ("p = trainer.strategy.pipeline\nq = self.step_strategy.pipeline\nr = getattr(s, 'pipeline', None)\n"
               "any(m.holds_part_of_model for m in mods)\nhasattr(m, 'holds_part_of_model')\n")
    assert pipeline_probes(planted) == ["1: .pipeline", "2: .pipeline", "3: getattr('pipeline')",
                                        "4: .holds_part_of_model", "5: 'holds_part_of_model'",
                                        "5: hasattr('holds_part_of_model')"]
    assert pipeline_probes("self.pipeline(model)\nstrategy.holds_whole_model\n") == []


def test_no_pipeline_probe_outside_the_strategies():
    found = {}
    for path in sorted((ROOT / "lit_moe").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if not name.startswith(PIPELINE_HOME):
            hits = pipeline_probes(path.read_text())
            if hits:
                found[name] = hits
    assert found == {}
