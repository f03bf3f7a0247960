"""The shape of the code, checked: imports point one way (`pipelines` -> `trainer`), no import
cycles among our modules (counting imports inside functions), leaf modules import nothing of
ours, and the commands that need no torch do not load it."""

import ast
import functools
import subprocess
import sys
import textwrap

import pytest
from helpers.paths import REPO

PACKAGES = ("trainer", "pipelines")
LEAVES = ("kfvision.trainer.cpus", "kfvision.trainer.errors", "kfvision.trainer.fileio",
          "kfvision.trainer.progressbar", "kfvision.trainer.presets",
          "kfvision.trainer.upstream", "kfvision.trainer.model.catalog")
# What a leaf may import all the same: other leaves (so no cycle can form through it).
LEAF_IMPORTS = {"kfvision.trainer.fileio": {"kfvision.trainer.errors"},
                "kfvision.trainer.presets": {"kfvision.trainer.errors",
                                             "kfvision.trainer.model.catalog"}}
# Third-party packages only one module of ours imports (every other goes through it).
CONFINED = {"openvino": {"kfvision.trainer.use.predict"},
            "onnxruntime.quantization": {"kfvision.trainer.use.quantize"}}


@functools.cache
def _parsed(path) -> ast.Module:
    """The syntax tree of a file, parsed once a process: a dozen tests here walk every module
    (read-only walks)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _module_name(path) -> str:
    """The import name of a file of ours: its folder under `kfvision.` (setup.py)."""
    parts = ["kfvision", *path.relative_to(REPO).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """module -> the project modules it imports anywhere in its file (functions included)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of this module
                    pkg = name.split(".")[: len(name.split(".")) - (0 if is_pkg else 1)]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in files and t != name}
        graph[name] = deps
    return graph


def importers(package: str) -> set:
    """Our modules that import `package` (or a module under it) anywhere in their file."""
    found = set()
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(_parsed(path)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and
                         not node.level else [])
                if any(n == package or n.startswith(package + ".") for n in names):
                    found.add(_module_name(path))
    return found


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_there_are_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_trainer_never_imports_the_pipelines():
    graph = import_graph()
    assert {m: sorted(d) for m, d in graph.items()
            if m.startswith("kfvision.trainer.")
            and any(x.startswith("kfvision.pipelines.") for x in d)} == {}


# The wings of pipelines/, lowest first: a module imports from its own layer or a lower one,
# never a higher. contract.py (a script's folders and their variables) is a leaf everything may
# read; the pipeline's wing (flow/) stands beside tune/, under the command line.
LAYERS = (("contract",), ("clients",), ("jobs", "serve"), ("script",), ("tune", "flow"), ("cli",))


def _layer(module: str):
    """The layer of a module under kfvision.pipelines (None for the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["kfvision", "pipelines"] or len(parts) < 3:
        return None
    return next(i for i, wings in enumerate(LAYERS) if parts[2] in wings)


def test_every_wing_of_pipelines_has_a_layer():
    wings = {p.stem if p.is_file() else p.name for p in (REPO / "pipelines").iterdir()
             if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert wings == {w for layer in LAYERS for w in layer}


def test_no_import_points_up_the_layers_of_pipelines():
    graph = import_graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m))
    assert up == []


def test_the_layer_check_finds_an_arrow_up():
    assert _layer("kfvision.pipelines.clients.s3") < _layer("kfvision.pipelines.script.boot")
    assert _layer("kfvision.pipelines.flow.steps.train") == _layer("kfvision.pipelines.tune.study")


@pytest.mark.parametrize("package", CONFINED)
def test_confined_packages_are_imported_by_their_module_only(package):
    assert importers(package) == CONFINED[package]


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_ours(leaf):
    assert import_graph()[leaf] <= LEAF_IMPORTS.get(leaf, set())


_RUN = textwrap.dedent("""
    import csv, sys
    from kfvision.pipelines.cli import main
    command, tmp, data = sys.argv[1:]
    if command == "evaluate":
        with open(tmp + "/scored.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "label", "scored_label", "scored_probability_a",
                        "scored_probability_b"])
            w.writerows([["1.png", "a", "a", 0.9, 0.1], ["2.png", "b", "a", 0.6, 0.4]])
        rc = main(["evaluate", "--scored", tmp + "/scored.csv", "--out", tmp + "/eval"])
    else:
        rc = main(["split", data, tmp + "/first", tmp + "/second", "--fraction", "0.5"])
    print(rc, "torch" in sys.modules)
""")


@pytest.mark.parametrize("command", ["evaluate", "split"])
def test_commands_that_need_no_torch_do_not_load_it(command, tmp_path, tiny_digits):
    run = subprocess.run([sys.executable, "-c", _RUN, command, str(tmp_path),
                          str(tiny_digits["train"])], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["0", "False"]


def _trees():
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            yield _module_name(path), _parsed(path)


def test_no_module_uses_another_modules_private_names():
    """`from pipelines.x import _y` and `x._y` on a module of ours imported as `x` are what
    drifted before. The rule, stated here: what a module shares, it names publicly."""
    ours = {name for name, _ in _trees()}
    found = []
    for name, tree in _trees():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in ours:  # a module imported by name
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif node.module in ours and a.name.startswith("_"):
                        found.append(f"{name}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname in ours})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert found == []


def _importers(*packages: str) -> set:
    """Our modules that import any of `packages` (or their submodules), anywhere in the file."""
    found = set()
    for name, tree in _trees():
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] in packages for m in mods):
                found.add(name)
    return found


# Outside systems, one rule: each system's client libraries are imported by its one client module
# under pipelines/clients/ (which maps its failures onto the named errors once), never elsewhere.
# The one exception is the trainer's MLflow tracking (trainer/ cannot import pipelines/; the
# registry client classifies MLflow's failures through kfvision.trainer.tracking.failure).
CLIENTS = "kfvision.pipelines.clients."
OUTSIDE_SYSTEMS = {  # system -> (its client libraries, the modules that may import them)
    "Kubernetes API": (("kubernetes",), {"kfvision.pipelines.clients.k8s"}),
    # s3obstore is the GET of s3's downloads (obstore's, its failures as botocore's, mapped by
    # s3); s3get botocore's request for what obstore does not take; s3put the multipart upload
    "object storage": (("boto3", "botocore", "s3transfer", "s3fs", "obstore"),
                       {"kfvision.pipelines.clients.s3", "kfvision.pipelines.clients.s3get",
                        "kfvision.pipelines.clients.s3obstore",
                        "kfvision.pipelines.clients.s3put"}),
    "MLflow": (("mlflow",), {"kfvision.pipelines.clients.registry", "kfvision.trainer.tracking"}),
    "Kubeflow Model Registry": (("model_registry",), {"kfvision.pipelines.clients.registry"}),
}
OUTSIDE_THE_FOLDER = {"kfvision.trainer.tracking"}


@pytest.mark.parametrize("system", OUTSIDE_SYSTEMS)
def test_each_outside_system_is_reached_through_its_client_module_only(system):
    libraries, allowed = OUTSIDE_SYSTEMS[system]
    found = _importers(*libraries)
    assert found and found <= allowed
    assert {m for m in found if not m.startswith(CLIENTS)} <= OUTSIDE_THE_FOLDER


# Names other platforms define, and the one module of ours that may spell them (docs/upstream.md
# lists each with its released source). Prose (docstrings, help texts) may mention them; a string
# that *is* one of them (starts with it) lives in its platform's module and is imported elsewhere.
PLATFORM_NAMES = {
    "trainer.kubeflow.org": {"kfvision.pipelines.jobs.trainjob.rules", "kfvision.trainer.upstream"},
    "jobset.sigs.k8s.io/": {"kfvision.pipelines.jobs.trainjob.rules"},
    "batch.kubernetes.io/": {"kfvision.pipelines.jobs.trainjob.rules"},
    "PET_": {"kfvision.pipelines.jobs.trainjob.rules", "kfvision.pipelines.jobs.pytorchjob.local",
             "kfvision.pipelines.jobs.procs"},
             # the operator's env (local.py), torchrun's (procs.py)
    "training.kubeflow.org/": {"kfvision.pipelines.jobs.pytorchjob.rules"},
    "pytorchjob-port": {"kfvision.pipelines.jobs.pytorchjob.rules"},
    "katib.kubeflow.org/": {"kfvision.pipelines.tune.katib_rules"},
    "serving.kserve.io": {"kfvision.pipelines.serve.deploy"},
    "KUBEFLOW_TRAINER_": {"kfvision.trainer.upstream"},
    "nvidia.com/gpu": {"kfvision.pipelines.clients.k8s"},
}


def test_each_platforms_names_are_spelled_in_one_module():
    found = {}
    for name, tree in _trees():
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings):
                for prefix in PLATFORM_NAMES:
                    if node.value.startswith(prefix):
                        found.setdefault(prefix, set()).add(name)
    stray = {p: sorted(mods - PLATFORM_NAMES[p]) for p, mods in found.items()
             if mods - PLATFORM_NAMES[p]}
    assert stray == {}


# What only pipelines/jobs/render.py calls outside pipelines/jobs/: the one place that dispatches
# on the job kind (each kind's builder and local runner)
KIND_DISPATCH = {"kfvision.pipelines.jobs.pytorchjob.build": {"build_pytorchjob", "set_command"},
                 "kfvision.pipelines.jobs.trainjob.build": {"build_trainjob", "set_command"},
                 "kfvision.pipelines.jobs.pytorchjob.local": {"run_local"},
                 "kfvision.pipelines.jobs.trainjob.local": {"run_local"}}


def test_only_render_dispatches_on_the_job_kind():
    found = []
    for path in (REPO / "pipelines").rglob("*.py"):
        name = _module_name(path)
        if name.startswith("kfvision.pipelines.jobs."):
            continue
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.module in KIND_DISPATCH:
                found += [f"{name}: {a.name}" for a in node.names
                          if a.name in KIND_DISPATCH[node.module]]
            elif isinstance(node, ast.ImportFrom) and node.module in (
                    "kfvision.pipelines.jobs.pytorchjob", "kfvision.pipelines.jobs.trainjob"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names
                          if a.name in ("build", "local")]
    assert found == [], ("use kfvision.pipelines.jobs.render (render_job, render_command_job, "
                         "run_local)")


def test_a_test_file_imports_test_files_of_its_own_folder_only():
    """Test folders mirror the packages; what files of two folders share lives in
    tests/helpers/ (pytest puts each test file's folder on sys.path as it collects it, so an
    import from another folder works in a whole run and breaks when a file is run alone)."""
    tests = REPO / "tests"
    found = []
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_") \
                    and not (path.parent / f"{node.module}.py").exists():
                found.append(f"{path.relative_to(tests)}: {node.module}")
    assert found == []


# The command line is thin: a module of pipelines/cli/ parses, calls a package, and prints. What
# two commands share is a package's (jobs/, script/, ...) or one of the two shared helpers below;
# a command module imports no other command module. cli/__init__.py registers every group, and
# the `job` group's parsers are added from its two further files (`add_*` only).
CLI = "kfvision.pipelines.cli"
CLI_SHARED = {f"{CLI}.clusterargs", f"{CLI}.flags"}
CLI_GROUP_PARTS = {f"{CLI}.job": {f"{CLI}.jobscript": {"add_run", "add_download"},
                                  f"{CLI}.jobstatus": {"add_status"}}}


def cli_imports_of_commands(trees) -> list:
    """'importer: module.name' for each name a cli module imports from another cli module that
    is neither a shared helper nor one of its group's parts' parsers."""
    found = []
    for name, tree in trees:
        if not name.startswith(CLI + ".") or name in CLI_SHARED:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{name}: {a.name}" for a in node.names
                          if a.name.startswith(CLI + ".") and a.name not in CLI_SHARED]
            elif isinstance(node, ast.ImportFrom) and (node.module == CLI or (
                    node.module or "").startswith(CLI + ".")):
                parts = CLI_GROUP_PARTS.get(name, {})
                for a in node.names:
                    if node.module == CLI and a.name in ("main", "build_parser"):
                        continue  # the command line itself (cli/__main__.py)
                    module = node.module if node.module != CLI else f"{CLI}.{a.name}"
                    if module in CLI_SHARED or a.name in parts.get(module, ()):
                        continue
                    found.append(f"{name}: {module}.{a.name}")
    return found


def test_no_cli_module_imports_another_cli_modules_functions():
    assert cli_imports_of_commands(t for t in _trees() if t[0] != CLI) == []


def test_the_cli_import_check_finds_one():
    tree = ast.parse("from kfvision.pipelines.cli.job import build_job\n"
                     "from kfvision.pipelines.cli.flags import NPROC_FLAG\n")
    assert cli_imports_of_commands([(f"{CLI}.tune", tree)]) == [f"{CLI}.tune: {CLI}.job.build_job"]


# No two modules share a name with different meanings: a name says a module's role. The names
# that several modules carry are listed here with the one role they share; any other repeated
# name fails (tools/, bench/ and tests/ are named after what they exercise, and are not checked).
SHARED_NAMES = {
    "__init__.py": "a package",
    # one act at its layers: the command (cli/), the pipeline step (flow/steps/), the package
    "train.py": ("training", {"pipelines/cli", "pipelines/flow/steps", "trainer"}),
    "data.py": ("image directories", {"pipelines/cli", "pipelines/flow/steps"}),
    "model.py": ("an untrained model directory", {"pipelines/cli", "pipelines/flow/steps"}),
    "store.py": ("pushing to object storage", {"pipelines/cli", "pipelines/flow/steps"}),
    "use.py": ("score, evaluate, export", {"pipelines/cli", "pipelines/flow/steps"}),
    "register.py": ("a model registry", {"pipelines/cli", "pipelines/flow/steps"}),
    "deploy.py": ("the InferenceService", {"pipelines/cli", "pipelines/flow/steps",
                                           "pipelines/serve"}),
    "pipeline.py": ("the KFP pipeline", {"pipelines/cli", "pipelines/flow"}),
    "jobstatus.py": ("where jobs stand", {"pipelines/cli", "pipelines/jobs"}),
    # the same part of each package
    "errors.py": ("a package's named errors", {"pipelines/jobs", "trainer"}),
    "config.py": ("a package's declared options", {"pipelines/jobs", "trainer"}),
    # the same part of each job kind
    "build.py": ("a kind's manifest", {"pipelines/jobs/pytorchjob", "pipelines/jobs/trainjob"}),
    "rules.py": ("a kind's platform rules", {"pipelines/jobs/pytorchjob",
                                             "pipelines/jobs/trainjob"}),
    "local.py": ("a kind's local run", {"pipelines/jobs/pytorchjob", "pipelines/jobs/trainjob"}),
}


def shared_names(paths) -> dict:
    """basename -> the folders of the modules that carry it, for names more than one carries."""
    folders = {}
    for path in paths:
        folders.setdefault(path.name, set()).add(path.parent.as_posix())
    return {n: f for n, f in folders.items() if len(f) > 1}


def names_of_different_roles(paths) -> dict:
    return {n: sorted(f) for n, f in shared_names(paths).items()
            if n != "__init__.py" and (n not in SHARED_NAMES or f != SHARED_NAMES[n][1])}


# stand-ins for other projects' packages (Azure ML's, Horovod's) carry those packages' names
FOREIGN_LAYOUTS = ("pipelines/script/shims",)


def test_no_two_modules_share_a_name_with_different_meanings():
    paths = [p.relative_to(REPO) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    paths = [p for p in paths if not p.as_posix().startswith(FOREIGN_LAYOUTS)]
    assert names_of_different_roles(paths) == {}


def test_the_name_check_finds_a_clash():
    from pathlib import PurePosixPath as P

    assert names_of_different_roles([P("pipelines/jobs/cluster.py"), P("pipelines/cli/cluster.py"),
                                     P("trainer/train.py"), P("pipelines/cli/train.py")]) == {
        "cluster.py": ["pipelines/cli", "pipelines/jobs"],
        "train.py": ["pipelines/cli", "trainer"]}
