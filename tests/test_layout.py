"""The package's shape: one subpackage per concern, each importing only the subpackages below it; no import
cycles between modules (imports inside functions counted); imports inside functions only where they keep
`llama-jax --help` fast or load an optional dependency; every subpackage says what it owns; and no module too
long to read in one sitting; and test hooks apart: only resilience/inject.py and config/ name the `inject_` settings.
Read from the source with ast."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llama_jax"

# Bottom to top: a module imports modules of its own subpackage, or of a subpackage (or top-level module) on a
# lower row, never of one above. The rows are the architecture; subpackages on one row do not import each other.
LAYERS = [
    ["llama_jax", "errors", "files"],  # the exit statuses and small helpers every layer shares
    ["config"],  # the one schema, its choices, loading and checks
    ["data"],  # text -> token stores -> batches (host side, no model)
    ["model"],  # Llama 3 and what its forward pass runs; knows only logical axis names
    ["distributed"],  # the mesh and THE logical-axis table; joining processes; agreements between them
    ["interop"],  # foreign formats: Hugging Face weights, PEFT adapters
    ["perf"],  # what the hardware can do and what a compiled step costs
    ["resilience"],  # guards, watchdog, stragglers, goodput, pre-flight, the supervisor
    ["checkpoint"],  # durable and local tiers, model specs, conversion, where a run starts
    ["inference"],  # decoding with a KV cache
    ["evaluation"],  # the lm-evaluation-harness backend and the task scores a run logs
    ["training"],  # the step, the optimizer, the loop, metrics
    ["planning"],  # plan, tune and the goodput projection: what a run will cost, before it runs
    ["api"],  # the Python API, thin
    ["cli"],  # the command line
    ["__main__"],  # python -m llama_jax
]
LAZY_IMPORTS_ALLOWED = {"cli"}  # the command line (cli/): `llama-jax --help` must not import JAX
# importlib: data/corpus.py's optional loader; lm_eval and huggingface_hub: the [eval] extra (evaluation/)
OPTIONAL_DEPENDENCIES = {"pyarrow", "datasets", "importlib", "wandb", "lm_eval", "huggingface_hub"}
# Imported where used because one process of a job uses them and each costs every process ~0.4 s at its start
# (training/report.py: only process 0 draws the report, at the end of a run).
START_COST_IMPORTS = {"matplotlib"}
MAX_LINES = 450
MAX_FUNCTION_LINES = 60
# A class of training/ that holds mutable state: at most this many fields and methods (a frozen record may hold more
# fields: it is read, never changed).
MAX_CLASS_FIELDS, MAX_CLASS_METHODS = 10, 15


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "llama_jax"
        found[name] = path
    return found


def unit(module: str) -> str:
    """The subpackage a module belongs to ('config.schema' -> 'config'), or the top-level module itself."""
    return module.split(".")[0]


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


def test_every_module_belongs_to_a_row():
    layered = [u for layer in LAYERS for u in layer]
    assert len(layered) == len(set(layered))
    assert sorted({unit(m) for m in modules()}) == sorted(layered)


def test_subpackages_import_only_their_row_or_below():
    row_of = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets if row_of[unit(b)] > row_of[unit(a)]]
    sideways = [
        f"{a} -> {b}"
        for a, targets in graph().items()
        for b in targets
        if unit(a) != unit(b) and row_of[unit(b)] == row_of[unit(a)] and row_of[unit(a)] > 0
    ]
    assert not upward
    assert not sideways


def test_no_import_cycles_counting_imports_inside_functions():
    edges, state, cycles = graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles


def test_imports_inside_functions_only_where_they_keep_the_cli_or_a_start_fast_or_are_optional():
    lazy = [
        f"{name}: {module}"
        for name, path in modules().items()
        if unit(name) not in LAZY_IMPORTS_ALLOWED
        for module, inside in imports(name, path)
        if inside and module.split(".")[0] not in OPTIONAL_DEPENDENCIES | START_COST_IMPORTS
    ]
    assert not lazy


@pytest.mark.parametrize("name", sorted(u for layer in LAYERS for u in layer if (PACKAGE / u).is_dir()))
def test_every_subpackage_says_what_it_owns(name):
    docstring = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
    assert docstring and len(docstring.splitlines()) >= 2, f"llama_jax/{name}/__init__.py needs a docstring"


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_are_short_enough_to_read(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concern"


def test_functions_are_short_enough_to_read():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"split these into named parts: {long}"


def _frozen(node: ast.ClassDef) -> bool:
    return any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
        for d in node.decorator_list
    )


def _fields(node: ast.ClassDef) -> set[str]:
    """A class's fields: annotated names in its body (a dataclass's) and attributes its methods set on self."""
    names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for target in (t for n in ast.walk(node) if isinstance(n, ast.Assign | ast.AnnAssign) for t in _targets(n)):
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            names.add(target.attr)
    return names


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def test_the_classes_of_training_that_change_are_small():
    """The loop's state lives in small parts (training/parts.py), not in one object a newcomer must hold in mind."""
    large = [
        f"{name}.{node.name}: {len(_fields(node))} fields, {len(methods)} methods"
        for name, path in modules().items()
        if unit(name) == "training"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and not _frozen(node)
        for methods in [[n for n in node.body if isinstance(n, ast.FunctionDef)]]
        if len(_fields(node)) > MAX_CLASS_FIELDS or len(methods) > MAX_CLASS_METHODS
    ]
    assert not large, f"split these by concern: {large}"


def test_the_model_reads_embed_stack_norm_head_in_a_screen():
    llama = next(
        n for n in ast.walk(ast.parse(modules()["model.llama"].read_text())) if getattr(n, "name", "") == "Llama"
    )
    call = next(n for n in llama.body if getattr(n, "name", "") == "__call__")
    assert call.end_lineno - call.lineno + 1 <= 30


# Test hooks apart from real logic: only the injector and the config (schema, range checks, the moved-keys table)
# name the injection keys' old `inject_` prefix; production modules call resilience/inject.py's Injector instead.
INJECTION_ALLOWED = {"resilience.inject", "config", "config.schema", "config.checks", "config.load", "config.choices"}


def test_only_the_injector_and_the_config_read_injection_settings():
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, path in modules().items()
        if name not in INJECTION_ALLOWED
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "inject_" in line
    ]
    assert not found


def test_llama_jax_help_does_not_import_jax():
    probe = "import sys; from llama_jax import cli; cli.build_parser(); print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
