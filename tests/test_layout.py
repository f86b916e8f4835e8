"""The package's shape: layers that import only below themselves, no import cycles (imports inside
functions counted), imports inside functions only where they keep `llama-jax --help` fast or load an
optional dependency, and no module too long to read in one sitting. Read from the source with ast."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llama_jax"

# Bottom to top: a module imports modules of its own layer or below, never above.
LAYERS = [
    ["llama_jax", "errors", "files", "hlo", "supervise", "vocabulary"],  # no JAX model code; shared helpers and the exit codes
    # the schema and vocabularies; host-side parts
    ["peft_config", "resilience_config", "config", "hardware", "goodput", "resilience", "distributed"],
    ["data.corpus", "data.tokenizer", "data.prepare", "data.loader", "data.pipeline", "data", "metrics", "report",
     "local_checkpoint"],  # local_checkpoint: host-side files and one collective, below checkpoint.py
    ["projection", "flash", "context_parallel", "cudnn", "attention", "loss", "remat", "optim", "pipeline",
     "model"],  # the model, which knows only logical axes (and the mesh axes of its shard_maps)
    ["sharding", "hf", "peft", "peft_format", "generate", "checkpoint"],  # meshes, formats on disk, adapters, decoding
    ["step", "costmodel"],  # the compiled programs of one config on one mesh
    ["plan", "weights", "preflight"],
    ["train", "tune"],
    ["api"],  # the Python API, thin
    ["cli", "__main__"],
]
LAZY_IMPORTS_ALLOWED = {"cli"}  # `llama-jax --help` must not import JAX
OPTIONAL_DEPENDENCIES = {"pyarrow", "datasets", "importlib", "wandb"}  # importlib: data/corpus.py's optional loader
MAX_LINES = 550


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "llama_jax"
        found[name] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import statement of a module; llama_jax modules
    relative to the package ('config', 'data.loader', 'llama_jax' for the package itself)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):  # from llama_jax.data import loader: the module data.loader
                assert child.level == 0, f"{name}: use absolute imports"
                found.extend((f"{child.module}.{alias.name}", in_function) for alias in child.names)
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    known = modules()
    resolved = []
    for module, inside in found:  # the longest prefix that is a module: llama_jax.config.Config -> config
        parts = module.removeprefix("llama_jax.").split(".") if module.startswith("llama_jax.") else []
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        resolved.append((next((p for p in prefixes if p in known), "llama_jax") if parts else module, inside))
    return resolved


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m, _ in imports(name, path) if m in known and m != name} for name, path in known.items()}


def test_every_module_has_a_layer():
    layered = [m for layer in LAYERS for m in layer]
    assert sorted(layered) == sorted(modules())
    assert len(layered) == len(set(layered))


def test_modules_import_only_their_layer_or_below():
    layer_of = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer_of[b] > layer_of[a]]
    assert not upward


def test_no_import_cycles_counting_imports_inside_functions():
    edges, state, cycles = graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles


def test_imports_inside_functions_only_where_they_keep_the_cli_fast_or_are_optional():
    lazy = [f"{name}: {module}" for name, path in modules().items() if name not in LAZY_IMPORTS_ALLOWED
            for module, inside in imports(name, path) if inside and module.split(".")[0] not in OPTIONAL_DEPENDENCIES]
    assert not lazy


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_are_short_enough_to_read(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concern"


def test_llama_jax_help_does_not_import_jax():
    import subprocess
    import sys

    probe = "import sys; from llama_jax import cli; cli.build_parser(); print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
