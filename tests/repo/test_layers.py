"""The import graph of dspark_rt: no cycles, and no import that runs up the layers (README,
"Layout"). Read from the source with ast (imports inside functions included), so a lazy import
cannot hide a dependency. The checks are functions of a graph, so a planted import can be fed to
them; each is seen failing on one below."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "dspark_rt"

# Bottom to top. A module may import modules of its own layer and of the layers below.
LAYERS = [
    ("kernels and plain types", ["_C", "ops", "nvml", "sampling_params", "outputs", "batch",
                                  "structured"]),
    ("checkpoint I/O", ["checkpoint"]),
    ("models", ["models"]),
    ("policies", ["policies"]),
    ("runner", ["runner"]),
    ("tensor parallelism", ["parallel"]),
    ("engine", ["engine"]),
    ("facade", ["decoder", "engine_args", "inputs", "llm", ""]),  # "": the package's own __init__ (the public names)
    ("HTTP server", ["server"]),
    ("command-line tools", ["tools"]),  # `serve` starts the server
    ("training", ["train"]),  # its command line reuses the tools' argument checks
    ("command line", ["__main__"]),
    # test and benchmark support sits on top: it may use any layer (tiny checkpoints in the
    # training's tokenizer format, rounds of the runner), and nothing in the package uses it
    ("test support", ["testing"]),
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
    return _imports_of(path.read_text(), _module(path), path.name == "__init__.py")


def _imports_of(source: str, mod: str, is_package: bool) -> set[str]:
    """Modules of dspark_rt that `source`, the text of module dspark_rt.<mod>, imports."""
    package = mod.split(".") if is_package else mod.split(".")[:-1]
    package = [p for p in package if p]
    out = set()
    for node in ast.walk(ast.parse(source)):
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


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of graph that run up the layers, one line each."""
    return [f"dspark_rt.{m} ({LAYERS[_layer(m)][0]}) imports dspark_rt.{d} ({LAYERS[_layer(d)][0]})"
            for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) > _layer(m)]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def test_no_import_runs_up_the_layers():
    bad = _upward(_graph())
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_an_import_from_the_engine_into_ops():
    """ops importing the engine is both an upward import and a cycle: both checks catch it."""
    graph = _graph()
    graph["ops"] = graph["ops"] | {"engine.engine"}
    assert any(line.startswith("dspark_rt.ops ") and "dspark_rt.engine.engine" in line
               for line in _upward(graph))
    assert any("ops" in c for c in _cycles(graph))


@pytest.mark.parametrize("mod,source", [
    ("tools.demo", "from .. import testing\n"),  # the demo's old random-pair fallback
    ("train.tokenizer_train", "from ..testing import CHAT_TEMPLATE, SPECIAL_TOKENS\n"),
    ("server.app", "def f():\n    from dspark_rt.testing.fixtures import write_tiny_target\n"),
    ("tools.serve", "from ..train import tokenizer_train\n"),  # tools sit below training
])
def test_a_planted_fixture_import_fails_the_layer_check(mod, source):
    """The module's source as written (parsed as the real files are) put in place of the real
    module: the layer check names it."""
    graph = _graph()
    assert mod in graph
    graph[mod] = _imports_of(source, mod, is_package=False)
    assert graph[mod], f"the parser found no dspark_rt import in {source!r}"
    bad = _upward(graph)
    assert any(line.startswith(f"dspark_rt.{mod} ") for line in bad), bad


def test_every_package_is_installed():
    """pyproject.toml lists its packages by hand: a package missing there is missing from a
    non-editable install (the GPU scripts install that way)."""
    import tomllib
    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("dspark_rt",) + p.parent.relative_to(PKG).parts) for p in PKG.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
