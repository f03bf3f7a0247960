"""CI's static check: pyright resolves every `kfvision` import (`make pyright`).

Runs pyright (its settings: pyproject.toml's [tool.pyright]) over the repository and fails on any
diagnostic that says a `kfvision` module or name cannot be found: an import that does not
resolve, or a name a `kfvision` module does not have. What it does NOT check: pyright's other
type errors, which it counts and prints but does not fail on (the code was not written to pass
them; see docs/development.md, "What CI runs").

    python -m tools.pyright_imports build/pyright/node_modules/.bin/pyright
"""

import json
import re
import subprocess
import sys
from collections import Counter

# what pyright says of a kfvision module it cannot find or a name such a module lacks
UNRESOLVED = re.compile(r'Import "kfvision[.\w]*" could not be resolved'
                        r'|is not a known attribute of module "kfvision[.\w]*"'
                        r'|"\w+" is unknown import symbol')


def unresolved(report: dict) -> list:
    """The diagnostics of `report` (pyright --outputjson) about kfvision's names."""
    out = []
    for d in report.get("generalDiagnostics", []):
        if UNRESOLVED.search(d["message"]) and "kfvision" in _line(d):
            out.append(d)
    return out


def _line(d: dict) -> str:
    try:
        with open(d["file"]) as f:
            return f.readlines()[d["range"]["start"]["line"]]
    except (OSError, IndexError, KeyError):
        return d["message"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    run = subprocess.run([argv[0], "--outputjson"], capture_output=True, text=True)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        print(f"pyright gave no report (exit {run.returncode}):\n{run.stdout}{run.stderr}",
              file=sys.stderr)
        return 2
    bad = unresolved(report)
    rules = Counter(d.get("rule", "?") for d in report.get("generalDiagnostics", [])
                    if d["severity"] == "error")
    s = report["summary"]
    print(f"pyright {report.get('version', '?')}: {s['filesAnalyzed']} files, "
          f"{s['errorCount']} type errors not checked here ({dict(rules.most_common(5))}...)")
    for d in bad:
        line = d["range"]["start"]["line"] + 1
        print(f"{d['file']}:{line}: {d['message']}", file=sys.stderr)
    print(f"unresolved kfvision imports: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
