"""The import graph of the titan_rl package has no cycle.

Every module of titan_rl (with titan_rl.models and titan_rl.kernels, which install from
the models/ and kernels/ folders) is parsed with `ast`, not executed. An edge a -> b is
an import in a's source of the project module b, wherever the statement is: at module
level (runs when a is imported: a cycle there is a partially initialised module) and
inside functions (runs later: a cycle there means the two modules are one unit split in
two). Not counted: imports under `if TYPE_CHECKING:` (never run) and modules named by a
string (importlib, vLLM's "module:Class" entries), which no parser can resolve.
`from a import b` is an edge to the module a.b when it exists, else to a.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil

ROOTS = ("titan_rl", "titan_rl.models", "titan_rl.kernels")


def project_modules() -> dict[str, str]:
    """Module name -> source file, for every module of the titan_rl package."""
    found: dict[str, str] = {}
    for root in ROOTS:
        pkg = importlib.import_module(root)
        found[root] = pkg.__file__
        for info in pkgutil.walk_packages(pkg.__path__, root + "."):
            spec = importlib.util.find_spec(info.name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                found[info.name] = spec.origin
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _package_of(name: str, path: str) -> str:
    return name if path.endswith("__init__.py") else name.rpartition(".")[0]


def imports_of(name: str, path: str, modules: dict[str, str]) -> list[tuple[str, int]]:
    """(imported project module, line) for each import statement in the module's source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    skip = _type_checking_nodes(tree)
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in dict.fromkeys(targets) if t in modules and t != name]
    return out


def import_graph() -> dict[str, dict[str, int]]:
    modules = project_modules()
    return {name: dict(imports_of(name, path, modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_every_part_of_the_package():
    from titan_rl.registry import list_architectures

    modules = project_modules()
    for name in ("titan_rl.registry", "titan_rl.titan.parallelize", "titan_rl.vllm.engine",
                 "titan_rl.models.common", "titan_rl.kernels.moe.torch_impl"):
        assert name in modules
    for arch in list_architectures():  # every registered architecture's folder and its files
        for part in ("", ".config", ".model", ".spec"):
            assert f"titan_rl.models.{arch}{part}" in modules, (arch, part)


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_relative_and_from_imports_resolve(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from . import b\nfrom .b import x\nfrom typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from p import c\n"
                   "def f():\n    import p.c\n")
    modules = {"p": "", "p.b": "", "p.c": "", "p.m": str(src)}
    assert sorted(imports_of("p.m", str(src), modules)) == [("p.b", 1), ("p.b", 2), ("p.c", 7)]


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle: " + " | ".join(steps))


def package_of(module: str) -> str:
    """The unit of the package-level graph: titan_rl's second level (a subpackage such as
    titan_rl.rl or titan_rl.kernels, or a top-level module such as titan_rl.config)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for a, edges in graph.items():
        for b, line in edges.items():
            if package_of(a) != package_of(b):
                out.setdefault(package_of(a), {}).setdefault(package_of(b), line)
    return out


def test_no_import_cycle_between_packages():
    graph = import_graph()
    packages = package_graph(graph)
    cycle = find_cycle(packages)
    if cycle:
        where = []
        for a, b in zip(cycle, cycle[1:]):
            edge = next((m, n, ln) for m, edges in graph.items() for n, ln in edges.items()
                        if package_of(m) == a and package_of(n) == b)
            where.append(f"{a} -> {b} ({edge[0]} line {edge[2]} imports {edge[1]})")
        raise AssertionError("package import cycle: " + " | ".join(where))


def test_the_engine_side_does_not_import_the_trainer_side():
    """titan_rl.vllm builds the model from its folder and shards it with titan_rl.parallel:
    nothing of TorchTitan's side (titan_rl.titan) is needed, or allowed, to serve it."""
    graph = import_graph()
    bad = [(m, n, ln) for m, edges in graph.items() if m.startswith("titan_rl.vllm")
           for n, ln in edges.items() if n.startswith("titan_rl.titan")]
    assert not bad, bad


def test_the_config_does_not_import_the_rl_step():
    """Reading a config needs its rules (titan_rl.layout, the recipes, the sections), never the
    RL step: titan_rl.config imports nothing of titan_rl.rl, directly or through anything it
    imports (function-level imports included)."""
    graph = import_graph()
    seen, todo = set(), ["titan_rl.config"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(n for n in graph.get(m, {}) if n.startswith("titan_rl"))
    assert not [m for m in seen if m.startswith("titan_rl.rl.") or m == "titan_rl.rl"], sorted(seen)


def test_generic_code_imports_no_model():
    """The generic TP, FSDP and quantized-weight code reads the architecture's spec and
    the shared layers (titan_rl.models.layers), never a model of its own."""
    graph = import_graph()
    generic = ("titan_rl.titan.parallelize", "titan_rl.parallel.plan", "titan_rl.parallel.tp_linear",
               "titan_rl.quant_weights", "titan_rl.vllm.model", "titan_rl.contract", "titan_rl.checkpoint")
    from titan_rl.registry import list_architectures

    models = tuple(f"titan_rl.models.{name}" for name in list_architectures())
    bad = [(m, n) for m in generic for n in graph[m] if n.startswith(models)]
    assert not bad, bad


def _folder(module: str) -> str | None:
    """The model folder a module belongs to (titan_rl.models.<folder>.*), or None."""
    parts = module.split(".")
    return parts[2] if module.startswith("titan_rl.models.") and len(parts) >= 3 else None


def folders_reached(graph: dict[str, dict[str, int]], names: list[str]) -> dict[str, dict[str, str]]:
    """For each model folder in `names`: the other model folders its files import, each with
    one importing module and line."""
    out: dict[str, dict[str, str]] = {}
    for m, edges in graph.items():
        for n, line in edges.items():
            a, b = _folder(m), _folder(n)
            if a in names and b in names and a != b:
                out.setdefault(a, {}).setdefault(b, f"{m} line {line}")
    return out


def test_model_folders_import_only_common_code():
    """models/<name>/ imports models/common, the shared layers and kernels, not another model's
    folder (TorchTitan's habit: a model folder reads as that architecture's maths). Every
    registered architecture's folder is checked."""
    from titan_rl.registry import list_architectures

    reached = folders_reached(import_graph(), list_architectures())
    assert not reached, f"model folders importing another model folder: {reached}"


def test_a_folder_importing_another_is_found(tmp_path):
    """The check above sees a model folder's import of another folder, wherever it is."""
    src = tmp_path / "model.py"
    src.write_text("from titan_rl.models.common.transformer import CausalLM\n"
                   "def f():\n    from titan_rl.models.b.model import X\n")
    modules = {"titan_rl.models.a.model": str(src), "titan_rl.models.b.model": "",
               "titan_rl.models.common.transformer": ""}
    graph = {"titan_rl.models.a.model": dict(imports_of("titan_rl.models.a.model", str(src), modules))}
    assert folders_reached(graph, ["a", "b"]) == {"a": {"b": "titan_rl.models.a.model line 3"}}


def test_every_package_is_listed_for_installation():
    """pyproject.toml lists its packages by name (package-dir maps models/ and kernels/), so a
    new package folder that is not listed imports in an editable install but is missing
    from a wheel. Every package found here must be in the list, and nothing else but the
    data-only folders (kernels/csrc)."""
    import os
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools["packages"]) - set(setuptools.get("package-data", {}))  # data-only folders
    found = {name for name, path in project_modules().items() if path.endswith("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml's list: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
