"""The house: commands at the root, the library in gpt/'s folders, arrows one way (commands -> library
-> model.py and configurator.py), each gpt/ folder importing only those below it (FLOORS), no circles,
no command imported, files and functions of a readable size, a README file tree that names what is
there. Every import (inside functions too) of every Python file outside tests/, read with ast."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = {"model", "configurator"}  # the root's two modules that are not commands
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_ROOT_FILES = 650, 80, 10
# gpt/'s folders, each on a floor: a module may import its own folder's and those of lower floors
FLOORS = {"device": 0, "data": 1, "outdir": 2, "train": 3, "weights": 3, "inference": 4, "evaluation": 4, "rl": 5}


def sources(repo=REPO):
    """{module name: path} of the repo's Python files outside tests/ and hidden folders."""
    found = {}
    for path in sorted(repo.rglob("*.py")):
        rel = path.relative_to(repo)
        if rel.parts[0] in ("tests",) or any(part.startswith(".") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def commands(modules):
    """The root's commands: its modules that run as a program (a __main__ guard), but model.py and
    configurator.py."""
    return {
        m
        for m, path in modules.items()
        if "." not in m
        and path.name != "__init__.py"
        and m not in CORE
        and re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M)
    }


def imports_of(path, modules):
    """The repo modules one file imports, anywhere in it (module level or inside a function)."""

    def resolve(name):  # the longest repo module the dotted name starts with
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from gpt import checkpoint` imports the module gpt.checkpoint; `from model import GPT`, model
            out |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
    return out - {""}


def graph(repo=REPO):
    modules = sources(repo)
    return modules, {m: imports_of(path, modules) - {m} for m, path in modules.items()}


def reachable(edges, v):
    """Every module v imports, directly or through others."""
    seen, todo = set(), [v]
    while todo:
        new = set(edges.get(todo.pop(), ())) - seen
        seen |= new
        todo += new
    return seen


def circles(edges):
    """Each strongly connected component of more than one module (modules that reach each other), as
    one circle through it."""
    reach = {v: reachable(edges, v) for v in edges}
    found = {frozenset({v} | {w for w in reach[v] if v in reach[w]}) for v in edges if v in reach[v]}
    return [f"{cycle_through(c, edges)} (the circle's modules: {', '.join(sorted(c))})" for c in sorted(found, key=min)]


def folder(module):
    """gpt/'s folder a module lives in ('train' for gpt.train.muon), or None outside gpt/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gpt" and len(parts) > 1 else None


def cycle_through(component, edges):
    """'a -> b -> ... -> a' for one shortest circle from the component's first module."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & component):
            if w == start:
                return " -> ".join(path + [start])
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return " / ".join(sorted(component))


def problems(repo=REPO):
    """Every broken rule of the arrows, one line each."""
    modules, edges = graph(repo)
    cmds = commands(modules)
    arrows = [(m, t) for m in sorted(edges) for t in sorted(edges[m])]
    found = [f"import circle: {c}" for c in circles(edges)]
    found += [f"{m} imports the command {t}" for m, t in arrows if t in cmds]
    found += [f"{m} (the network or the config) imports {t}" for m, t in arrows if m in CORE and t not in CORE]
    found += [f"{m} imports the script {t}" for m, t in arrows if t.startswith(("scripts.", "dev."))]
    floor = lambda m: FLOORS.get(folder(m), -1)
    below = lambda m: ", ".join(f for f, n in FLOORS.items() if n < floor(m)) or "none"
    found += [
        f"{m} imports {t}: gpt/{folder(m)}/ may import only its own folder and those below it ({below(m)})"
        for m, t in arrows
        if folder(m) and folder(t) and folder(t) != folder(m) and FLOORS.get(folder(t), 9) >= floor(m)
    ]
    outside = [m for m in sorted(modules) if m.startswith("gpt.") and m.split(".")[1] not in FLOORS]
    found += [f"{m} is outside gpt/'s folders ({', '.join(FLOORS)})" for m in outside]
    # data/ prepares datasets and imports the library; the library reads nothing from data/
    library = lambda m: not m.startswith(("data.", "scripts.", "dev.")) and m != "data"
    found += [
        f"{m} (the library or the root) imports the dataset preparation {t}"
        for m, t in arrows
        if library(m) and (t == "data" or t.startswith("data."))
    ]
    return found


def test_arrows_run_one_way():
    """No circle, counting imports inside functions; nothing imports a command, a script or a harness
    of the dev folder; model.py and configurator.py import nothing of the repo's but each other."""
    found = problems()
    assert not found, "\n".join(found)


def test_the_check_finds_a_circle_a_command_import_and_an_import_up_the_floors(tmp_path):
    """The check itself, on a small tree: a circle made by an import inside a function, a
    command that imports another, the library importing from data/, a folder importing one above
    it (inside a function: it counts), and a module outside the folders."""
    for name in ("gpt", "gpt/device", "gpt/outdir", "gpt/inference", "data"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "model.py").write_text("def generate():\n    from gpt.inference import sampling\n")
    (tmp_path / "gpt" / "inference" / "sampling.py").write_text("from gpt.outdir import checkpoint\n")
    (tmp_path / "gpt" / "outdir" / "checkpoint.py").write_text("from model import GPT\n")
    (tmp_path / "gpt" / "device" / "runtime.py").write_text("def f():\n    from gpt.outdir import checkpoint\n")
    (tmp_path / "gpt" / "helpers.py").write_text("")
    (tmp_path / "train.py").write_text("import eval as evals\nfrom gpt.outdir import checkpoint\n")
    (tmp_path / "eval.py").write_text("import model\n\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "data" / "tokens.py").write_text("from gpt.outdir import checkpoint\n")  # data -> gpt: the right way
    (tmp_path / "gpt" / "outdir" / "batches.py").write_text("from data import tokens\n")  # gpt -> data: refused
    assert problems(tmp_path) == [
        "import circle: gpt.inference.sampling -> gpt.outdir.checkpoint -> model -> gpt.inference.sampling "
        "(the circle's modules: gpt.inference.sampling, gpt.outdir.checkpoint, model)",
        "train imports the command eval",
        "model (the network or the config) imports gpt.inference.sampling",
        "gpt.device.runtime imports gpt.outdir.checkpoint: gpt/device/ may import only its own folder and those "
        "below it (none)",
        "gpt.helpers is outside gpt/'s folders (device, data, outdir, train, weights, inference, evaluation, rl)",
        "gpt.outdir.batches (the library or the root) imports the dataset preparation data.tokens",
    ]


def test_the_floors_name_gpts_folders_and_nothing_else():
    """FLOORS and `ls gpt/` agree: the seven folders, each with its one-line __init__.py."""
    folders = sorted(p.name for p in (REPO / "gpt").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(FLOORS)
    for name in folders:
        text = (REPO / "gpt" / name / "__init__.py").read_text()
        assert len(ast.parse(text).body) == 1 and len(text.strip().splitlines()) == 1, name  # a docstring, no exports


def test_the_root_holds_the_commands_and_the_library_is_one_package():
    root = sorted(p.name for p in REPO.glob("*.py"))
    assert len(root) <= MAX_ROOT_FILES, root
    assert {"train.py", "model.py", "configurator.py", "sample.py", "bench.py"} <= set(root)
    assert (REPO / "gpt" / "__init__.py").exists()


def test_the_readme_file_tree_names_every_module_and_no_other():
    """The annotated file tree in README.md lists the root's Python files and gpt/'s modules, and
    names none that is not there."""
    readme = (REPO / "README.md").read_text()
    tree = re.search(r"## Files\n.*?```(?:text)?\n(.*?)```", readme, re.S)
    assert tree, "README.md has no '## Files' section with a code block"
    named = set(re.findall(r"(?<![\w/<>.-])(\w[\w/]*\.py)\b", tree.group(1)))  # not data/<name>/prepare.py
    root = {p.name for p in REPO.glob("*.py")}
    package = {p.name for p in (REPO / "gpt").rglob("*.py") if p.name != "__init__.py"}
    missing = sorted((root | package) - {Path(n).name for n in named})
    assert not missing, f"README.md's file tree lacks {missing}"
    absent = sorted(
        n
        for n in named
        if not any((REPO / d / n).exists() for d in ("", "scripts", "dev", "data", "tests", "config"))
        and not any((REPO / "gpt").rglob(n))
    )
    assert not absent, f"README.md's file tree names files that do not exist: {absent}"


def long_functions(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                yield f"{path.relative_to(REPO)}:{node.lineno} {node.name} is {length} lines"


@pytest.mark.parametrize("limit", ["files", "functions"])
def test_no_file_or_function_is_oversized(limit):
    paths = sources().values()
    if limit == "files":
        found = [
            f"{p.relative_to(REPO)} is {n} lines"
            for p in paths
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
        ]
    else:
        found = [line for p in paths for line in long_functions(p)]
    assert not found, "\n".join(found)
