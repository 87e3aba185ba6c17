"""The import graph of dspark_rt: no cycles, and no import that runs up the layers (README,
"Layout"). Read from the source with ast (imports inside functions included), so a lazy import
cannot hide a dependency."""
import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "dspark_rt"

# Bottom to top. A module may import modules of its own layer and of the layers below.
LAYERS = [
    ("kernels and plain types", ["_C", "ops", "nvml", "sampling_params", "outputs", "batch"]),
    ("checkpoint I/O", ["checkpoint"]),
    ("models", ["models"]),
    ("policies", ["policies"]),
    ("runner", ["runner"]),
    ("tensor parallelism", ["parallel"]),
    ("engine", ["engine"]),
    ("facade", ["decoder", ""]),  # "": the package's own __init__ (the public names)
    ("tools, server, training, test support", ["tools", "server", "train", "testing", "__main__"]),
]


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _exists(mod: str) -> bool:
    """Whether dspark_rt.<mod> is a module or package (the extension _C counts, built or not)."""
    base = PKG.joinpath(*mod.split("."))
    return mod == "_C" or base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Modules of dspark_rt this file imports, relative to the package ("" is its __init__)."""
    mod = _module(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    package = [p for p in package if p]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "dspark_rt"]
            out |= {n.removeprefix("dspark_rt").lstrip(".") for n in names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "dspark_rt":
                target = node.module.removeprefix("dspark_rt").lstrip(".")
            else:
                continue
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            found = [s for s in subs if _exists(s)]  # `from pkg import module` names modules
            out |= set(found) if len(found) == len(subs) else {target}
    out.discard(mod)
    return out


def _layer(mod: str) -> int:
    top = mod.split(".")[0]
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"dspark_rt.{mod} belongs to no layer: add it to LAYERS in {__file__}")


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in PKG.rglob("*.py") if "pretrained" not in p.parts}


def test_no_import_runs_up_the_layers():
    bad = [f"dspark_rt.{m} ({LAYERS[_layer(m)][0]}) imports dspark_rt.{d} ({LAYERS[_layer(d)][0]})"
           for m, deps in sorted(_graph().items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):  # depth-first; a grey node met again closes a cycle
        state[m] = "grey"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == "grey":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "black"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_bad_import(monkeypatch):
    """ops importing the engine is both an upward import and a cycle: both checks catch it."""
    graph = _graph()
    graph["ops"] = graph["ops"] | {"engine.engine"}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
    for check in (test_no_import_runs_up_the_layers, test_no_import_cycles):
        try:
            check()
        except AssertionError as e:
            assert "ops" in str(e)
        else:
            raise AssertionError(f"{check.__name__} missed ops -> engine.engine")


def test_every_package_is_installed():
    """pyproject.toml lists its packages by hand: a package missing there is missing from a
    non-editable install (the GPU scripts install that way)."""
    import tomllib
    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("dspark_rt",) + p.parent.relative_to(PKG).parts) for p in PKG.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
