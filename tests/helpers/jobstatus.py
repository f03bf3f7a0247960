"""`kfvision job status` as the tests read it: the view it prints with --json, and a script
job run in a process of its own, watched through it while it runs."""

import json
import os
import subprocess
import sys
import time

from helpers.paths import REPO

STYLES = REPO / "tests" / "script" / "styles"


def local_status(name: str, log_dir, capsys) -> dict:
    """The view of the local run of job `name` in `log_dir` (what was captured before is
    dropped)."""
    from kfvision.pipelines.cli import main

    capsys.readouterr()
    assert main(["job", "status", name, "--log-dir", str(log_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_watched(tmp_path, name: str, style: str, script_args: list, tracking: str,
                capsys, target=("--entry", "train.py")) -> list:
    """`kfvision job run` of tests/script/styles/`style` 2 x 2 in a process of its own, its
    MLflow run at `tracking`, started as `target`; the views `job status` gave while it ran (from
    when its record is there), the last one after it ended. Its logs: tmp_path/logs."""
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "kfvision.pipelines.cli", "job", "run", "--name", name,
            "--image", "local", "--nodes", "2", "--nproc-per-node", "2", "--source",
            str(STYLES / style), *target, "--tracking-uri", tracking, "--quiet",
            "--log-dir", str(log_dir), "-o", str(tmp_path / "job.yaml"), "--", *script_args]
    views = []
    with open(tmp_path / "run.log", "wb") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            while proc.poll() is None:
                if (log_dir / "status.json").exists():
                    views.append(local_status(name, log_dir, capsys))
                time.sleep(0.3)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-4000:]
    views.append(local_status(name, log_dir, capsys))
    return views


def running_progress(views: list) -> list:
    """The progress of the views taken while the job ran, once it had a position."""
    return [v["progress"] for v in views if v["phase"] == "Running"
            and v["progress"].get("position")]


def mlflow_history(tracking: str, name: str, log_dir, metric: str) -> list:
    """(step, value) of `metric` in the MLflow run node 0's boot opened for the local run of
    job `name`: its id in the provenance file of node 0's model folder, else (a script that
    saved no model there) the newest run tagged with the job's name."""
    from kfvision.pipelines import contract
    from kfvision.pipelines.jobs.outputs import local_run
    from kfvision.trainer.tracking import JOB_TAGS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    model = local_run(name, log_dir) / contract.RESULTS["model"]
    if (model / contract.PROVENANCE).is_file():
        run_id = contract.read_provenance(model)["mlflow_run_id"]
    else:
        tag = JOB_TAGS["KFVISION_JOB_NAME"]
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, f"tags.`{tag}` = '{name}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, metric)
    return sorted((m.step, m.value) for m in history)
