"""`kfvision job status` as the tests read it: the view it prints with --json."""

import json


def local_status(name: str, log_dir, capsys) -> dict:
    """The view of the local run of job `name` in `log_dir` (what was captured before is
    dropped)."""
    from kfvision.pipelines.cli import main

    capsys.readouterr()
    assert main(["job", "status", name, "--log-dir", str(log_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)
