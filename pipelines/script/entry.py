"""Where a script job starts, checked against its snapshot before anything runs: the entry (or
module), the requirements file and the working folder must be in the packed source. `kfvision
job render --source` (pipelines/script/assemble.py) and the pipeline's train step
(pipelines/flow/steps/trainscript.py) both resolve them here; `name` says how each front end names
its settings in an error (`--entry` on the command line, `script_entry` in the pipeline).

    start = resolve(snap.files, source="proj", entry="./train.py")
    # -> {"entry": "train.py", "module": None, "requirements": "requirements.txt" or None,
    #     "workdir": None}

The requirements file, unless given, is requirements.txt beside the entry, else the source's
root's; `--module` is looked for where `python -m` finds it in the pod (`module_roots`): the
working folder, the source's root, and a `src/` project's package folder.
"""

from pathlib import Path

from kfvision.pipelines.jobs.errors import InvalidJobError

PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg")  # a packaged project's root
REQUIREMENTS = "requirements.txt"
FLAGS = {"source": "--source", "entry": "--entry", "module": "--module",
         "requirements": "--requirements", "workdir": "--workdir"}
_LEFT = " (it is missing, or .gitignore/.kfvisionignore leaves it out)"


def resolve(files, *, source: str, entry: str | None = None, module: str | None = None,
            requirements: str | None = None, workdir: str | None = None,
            name: dict = FLAGS) -> dict:
    """{entry, module, requirements, workdir} as the job carries them ('/'-separated, relative
    to the source; requirements defaults to requirements.txt beside the entry when packed).

    Raises:
        InvalidJobError: one of them is not in the snapshot's `files`.
    """
    files = set(files)
    entry, requirements, workdir = (Path(p).as_posix() if p else None  # ./train.py: train.py
                                    for p in (entry, requirements, workdir))
    src = f"{name['source']} {source}"
    if entry and entry not in files:
        raise InvalidJobError(f"{name['entry']} {entry} is not in {src}{_LEFT}: the snapshot "
                              f"holds {len(files)} file(s).")
    workdir = None if workdir in (None, ".") else workdir
    if module:
        base = module.replace(".", "/")
        roots = module_roots(files, workdir)
        if not any({f"{r}{base}.py", f"{r}{base}/__main__.py", f"{r}{base}/__init__.py"} & files
                   for r in (f"{r}/" if r else "" for r in roots)):
            where = " or ".join(f"{r or '.'}/" for r in roots)
            raise InvalidJobError(f"{name['module']} {module} is not in {src} (looked in "
                                  f"{where}, where python -m finds it){_LEFT}.")
    if workdir is not None and (Path(workdir).is_absolute() or ".." in Path(workdir).parts or
                                not any(f.startswith(f"{workdir}/") for f in files)):
        raise InvalidJobError(f"{name['workdir']} {workdir} is not a folder of {src}: give a "
                              "folder inside it that holds files.")
    if requirements and requirements not in files:
        raise InvalidJobError(f"{name['requirements']} {requirements} is not in {src}{_LEFT}.")
    if not requirements:
        requirements = default_requirements(files, entry)
    return {"entry": entry, "module": module, "requirements": requirements, "workdir": workdir}


def package_folder(files) -> str | None:
    """`src` when the source is a packaged project in the `src/` layout (a pyproject.toml,
    setup.py or setup.cfg at its root, Python files under src/), else None: the folder the
    job puts on the script's path (docs/scripts.md "Packaged projects")."""
    files = set(files)
    if not files & set(PROJECT_FILES):
        return None
    return "src" if any(f.startswith("src/") and f.endswith(".py") for f in files) else None


def module_roots(files, workdir: str | None) -> list:
    """The folders, relative to the source, where `python -m` finds a module in the job: the
    one it runs in (`workdir`), the source's root, and a `src/` project's package folder."""
    roots = [workdir or "", "", package_folder(files)]
    return list(dict.fromkeys(r for r in roots if r is not None))


def default_requirements(files, entry: str | None) -> str | None:
    """The requirements file a job uses when none is given: requirements.txt beside the entry,
    else at the source's root (a project's one file for every entry), else none."""
    files = set(files)
    beside = str(Path(entry or "x").parent / REQUIREMENTS).removeprefix("./")
    return next((f for f in (beside, REQUIREMENTS) if f in files), None)


def console_script(source: Path, name: str, flag: str = "--console-script") -> tuple:
    """(module, attribute) of the console script `name` that the project at `source` declares
    in its pyproject.toml's `[project.scripts]` (`train = "mypkg.train:main"`), read as pip's
    generated wrapper reads it (PyPA's entry points specification: `module:attr.attr`).

    Raises:
        InvalidJobError: no pyproject.toml, no such script, or a malformed reference.
    """
    tomllib = toml_module()
    if tomllib is None:
        raise InvalidJobError(f"{flag} {name}: reading pyproject.toml needs Python 3.11 (tomllib) "
                              "or the tomli package; give --module MODULE instead.")
    path = Path(source) / "pyproject.toml"
    try:
        scripts = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {}).get(
            "scripts", {})
    except (OSError, ValueError) as e:  # TOMLDecodeError is a ValueError
        raise InvalidJobError(f"{flag} {name}: cannot read [project.scripts] of {path}: {e}") \
            from e
    ref = scripts.get(name) if isinstance(scripts, dict) else None
    if not isinstance(ref, str):
        known = ", ".join(sorted(scripts)) if isinstance(scripts, dict) else ""
        raise InvalidJobError(f"{flag} {name} is not in [project.scripts] of {path} (it has: "
                              f"{known or 'none'}).")
    module, sep, attr = ref.partition(":")
    attr = attr.split("[", 1)[0].strip()  # extras, as in `main [gui]`, are not ours to install
    if not sep or not module.strip() or not attr:
        raise InvalidJobError(f"{flag} {name} = {ref!r} in {path} is not `module:function`.")
    return module.strip(), attr


def toml_module():
    """The standard library's TOML reader (Python 3.11), else tomli (its source), else None."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            return None
    return tomllib
