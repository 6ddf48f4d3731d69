"""The package is layered: no import cycle, and no module imports one of a higher layer.

    OMP_NUM_THREADS=1 pytest tests/unit/test_import_layers.py

Every module of ``elasticmem`` is parsed with ``ast`` (nothing is imported), and every import
statement counts: module-level, function-level and the ones under ``if TYPE_CHECKING:`` (a type
hint is still a dependency of the code that reads it; a layer that needs a higher layer's type
should take a protocol or ``Any`` instead). ``LAYERS`` below is the one place the order is
written; a module belongs to the layer of the longest prefix that names it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elasticmem"

# Lowest first: a module may import modules of its own layer and of the layers listed before it,
# never of a layer listed after it; within a layer, the cycle test keeps the imports acyclic.
# Evaluation's core (metrics, stats, the system protocol) and the baselines sit below training
# because the trainers use them: GRPO and the warm-up report eval metrics, and GRPO trains MemGen.
# The evaluation CLI and the ladder are apps (elasticmem.apps): they build systems from the registry
# and play ALFWorld episodes, both above eval.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation: helpers with no elasticmem imports", ("elasticmem.utils",)),
    ("config: every section's dataclass and variant tuples", ("elasticmem.config",)),
    ("data: schema, sources, chunking, synthetic tasks, rewards, validation", ("elasticmem.data",)),
    ("backbone: the frozen LM and its tokenizer", ("elasticmem.backbone",)),
    ("bank: the memory bank, its index and appends", ("elasticmem.bank",)),
    ("model: policy, projector, injection, retrieval map, ElasticMem", ("elasticmem.model",)),
    ("llm: text-generation clients and structured answers (text memory and the agent)", ("elasticmem.llm",)),
    ("eval core: system protocol, reader, metrics, stats, runner, reports",
     ("elasticmem.eval",)),
    ("baselines: MemGen, text memory, A-Mem", ("elasticmem.baselines",)),
    ("training runtime: stop flag, checkpoints, JSONL logs, retrieval targets",
     ("elasticmem.training",)),
    ("grpo: loss and trainer", ("elasticmem.grpo",)),
    ("warmup: reading warm-up and retrieval-map training", ("elasticmem.warmup",)),
    ("agent: ALFWorld episodes, imitation, skill cards", ("elasticmem.agent",)),
    ("systems: the registry of every evaluable system", ("elasticmem.systems",)),
    ("apps: CLIs and servers", ("elasticmem.apps", "elasticmem.live", "elasticmem.serve")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in (``a.b.C`` -> ``a.b``), or None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict[str, Path]) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported module, line)], every import statement in the file."""
    out: dict[str, list[tuple[str, int]]] = {}
    for mod, path in modules.items():
        edges = []
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for n in names:
                if n.split(".")[0] != "elasticmem":
                    continue
                target = _resolve(n, modules)
                if target and target != mod and target != "elasticmem":
                    edges.append((target, node.lineno))
        out[mod] = sorted(set(edges), key=lambda e: (e[1], e[0]))
    return out


def layer_of(mod: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _where(mod: str, line: int, modules: dict[str, Path]) -> str:
    return f"{modules[mod].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    for mod in _modules():
        if mod != "elasticmem":
            layer_of(mod)


def test_no_import_from_a_higher_layer():
    modules = _modules()
    bad = []
    for mod, edges in imports(modules).items():
        if mod == "elasticmem":
            continue
        for target, line in edges:
            if layer_of(target) > layer_of(mod):
                bad.append(f"{_where(mod, line, modules)}: {mod} [{LAYERS[layer_of(mod)][0].split(':')[0]}] "
                           f"imports {target} [{LAYERS[layer_of(target)][0].split(':')[0]}]")
    assert not bad, f"{len(bad)} upward imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    modules = _modules()
    edges = imports(modules)
    graph = {m: {t for t, _ in e} for m, e in edges.items()}
    found = cycles(graph)
    lines = []
    for comp in found:
        members = set(comp)
        lines.append("cycle: " + " <-> ".join(comp))
        for m in comp:
            for t, line in edges[m]:
                if t in members:
                    lines.append(f"  {_where(m, line, modules)}: {m} imports {t}")
    assert not found, "\n".join(lines)


def test_a_layer_is_made_of_whole_packages():
    # A module sits in its own package's layer: a module placed in a higher layer than its folder
    # (as the evaluation CLI once was) hides the upward imports between the two.
    nested = [p for _, prefixes in LAYERS for p in prefixes if p.count(".") != 1]
    assert not nested, f"layers name modules inside a package, not whole packages: {nested}"


def test_eval_imports_no_agent_and_no_systems():
    # Evaluation's core sits below the agent and the systems registry, which use it; an app that
    # needs them (the evaluation CLI, the ladder) lives in elasticmem.apps, above both.
    modules = _modules()
    bad = [f"{_where(m, line, modules)}: {m} imports {t}" for m, edges in imports(modules).items()
           if m == "elasticmem.eval" or m.startswith("elasticmem.eval.")
           for t, line in edges if t.split(".")[:2] in (["elasticmem", "agent"], ["elasticmem", "systems"])]
    assert not bad, "elasticmem.eval imports a layer above it:\n" + "\n".join(bad)


def test_cycle_search_finds_a_circle():
    # The search itself must be able to fail.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_config_loads_without_torch():
    code = ("import sys, elasticmem.config; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'faiss'}); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
