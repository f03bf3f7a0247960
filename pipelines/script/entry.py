"""Where a script job starts, checked against its snapshot before anything runs: the entry (or
module), the requirements file and the working folder must be in the packed source. `kfvision
job render --source` (pipelines/script/assemble.py) and the pipeline's train step
(pipelines/flow/steps/trainscript.py) both resolve them here; `name` says how each front end names
its settings in an error (`--entry` on the command line, `script_entry` in the pipeline).

    start = resolve(snap.files, source="proj", entry="./train.py")
    # -> {"entry": "train.py", "module": None, "requirements": "requirements.txt" or None,
    #     "workdir": None}
"""

from pathlib import Path

from kfvision.pipelines.jobs.errors import InvalidJobError

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
    if module:
        base = module.replace(".", "/")
        if not {f"{base}.py", f"{base}/__main__.py", f"{base}/__init__.py"} & files:
            raise InvalidJobError(f"{name['module']} {module} is not in {src}{_LEFT}.")
    workdir = None if workdir in (None, ".") else workdir
    if workdir is not None and (Path(workdir).is_absolute() or ".." in Path(workdir).parts or
                                not any(f.startswith(f"{workdir}/") for f in files)):
        raise InvalidJobError(f"{name['workdir']} {workdir} is not a folder of {src}: give a "
                              "folder inside it that holds files.")
    if requirements and requirements not in files:
        raise InvalidJobError(f"{name['requirements']} {requirements} is not in {src}{_LEFT}.")
    if not requirements:
        beside = str(Path(entry or "x").parent / "requirements.txt").removeprefix("./")
        requirements = beside if beside in files else None
    return {"entry": entry, "module": module, "requirements": requirements, "workdir": workdir}
