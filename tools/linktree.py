"""`kfvision.*` for static tools: a link tree and a .pth in the environment (`make setup`).

The repository keeps its folders `trainer/` and `pipelines/` at the top; setup.py maps them to
`kfvision.trainer` and `kfvision.pipelines`. An editable install (`pip install -e .`) makes that
mapping with an import hook (setuptools' `__editable___kfvision_*_finder`), which the
interpreter runs but pyright/Pylance, mypy and jedi do not: to them `kfvision` did not exist.

This writes `<env>/kfvision-src/kfvision/<folder>`, one symbolic link per folder to the
repository's own, and a `kfvision-src.pth` in the environment's site-packages naming
`<env>/kfvision-src`: a plain path, which every tool reads. The links are to folders, not files,
so a module added later is seen at once (setuptools' `editable_mode=strict` links each file, and a
new module would need a reinstall). `kfvision` stays a namespace package, as in the wheel.

    python -m tools.linktree          # the environment of this python
    python -m tools.linktree --check  # exit 1, saying what is missing, when it is not in place
"""

import argparse
import ast
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTH = "kfvision-src.pth"


def folders() -> tuple:
    """setup.py's FOLDERS (the one place they are named), read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                             if isinstance(t, ast.Name)] == ["FOLDERS"]:
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("tools.linktree: setup.py names no FOLDERS = (...): nothing to link")


def expected(prefix: Path) -> dict:
    """{path: what it should hold}: each link and its target, the .pth and its line."""
    root = prefix / "kfvision-src"
    want = {root / "kfvision" / f: REPO / f for f in folders()}
    want[Path(sysconfig.get_path("purelib", vars={"base": str(prefix)})) / PTH] = root
    return want


def problems(want: dict) -> list:
    out = []
    for path, target in want.items():
        if path.suffix == ".pth":
            if not path.is_file() or path.read_text().strip() != str(target):
                out.append(f"{path} does not name {target}")
        elif not path.is_symlink() or path.resolve() != target.resolve():
            out.append(f"{path} is not a link to {target}")
    return out


def write(want: dict) -> None:
    for path, target in want.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        if path.suffix == ".pth":
            path.write_text(f"{target}\n")
        else:
            path.symlink_to(target, target_is_directory=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is in place")
    args = parser.parse_args(argv)
    want = expected(Path(sys.prefix))
    if not args.check:
        write(want)
    missing = problems(want)
    for line in missing:
        print(f"tools.linktree: {line}: run `make setup` (or python -m tools.linktree)",
              file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
