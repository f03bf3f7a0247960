"""The search on this machine: an Optuna study whose trials are ordinary training runs.

Each trial runs `python -m kfvision.trainer.train` (or torchrun through kfvision.trainer.launch with
`--nproc-per-node`) in its own process and output folder, and Optuna reads the very metric line
Katib reads (trainer/reporting.py) from its log: the per-epoch objective drives median pruning,
the finished run's metrics.json gives the trial's value (the kept epoch's, as the model directory
holds). The study lives in DIR/study.db, so a killed `tune run` started again with the same
arguments keeps its finished trials and runs only the rest (an interrupted trial runs again).
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kfvision.pipelines.jobs.config import train_flags
from kfvision.pipelines.jobs.metriclines import parse_metrics
from kfvision.pipelines.tune.experiment import Search, direction
from kfvision.pipelines.tune.report import write_outputs
from kfvision.pipelines.tune.space import apply
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import options_of
from kfvision.trainer.reporting import METRICS, OBJECTIVES

log = logging.getLogger("kfvision.tune")
STUDY = "kfvision"


class TrialFailed(Exception):
    """A trial's training run failed (Optuna records the trial as FAIL and goes on)."""


def failed(message: str) -> TrialFailed:
    """Say why a trial failed, on stderr (Optuna's own warning goes to whichever stream its
    handler was made with), and return the TrialFailed to raise."""
    print(message, file=sys.stderr, flush=True)
    return TrialFailed(message)


def _sampler(search: Search, seed: int):
    import optuna

    if search.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.algorithm == "grid":
        return optuna.samplers.GridSampler({p.name: list(p.choices) if p.choices else
                                            list(range(p.low, p.high + 1))
                                            for p in search.params}, seed=seed)
    if search.algorithm == "bayesian":
        return optuna.samplers.GPSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def check_search(search: Search, script: bool = False) -> None:
    """Refuse what no search can run, before anything runs. `script`: a user's script's search
    (its objective is any name it prints, in the direction --goal says)."""
    if not search.params:
        raise InvalidParameterError("give at least one --param NAME=TYPE:SPEC to search.")
    for opt in options_of(Search):  # the ranges and choices Search declares
        if not (script and opt.name == "objective"):
            opt.check(getattr(search, opt.name), search)
    if search.parallel > search.trials:
        raise InvalidParameterError(f"--parallel {search.parallel} is more than --trials "
                                    f"{search.trials}: at most {search.trials} trials can run.")
    if search.algorithm == "grid" and any(p.type == "double" for p in search.params):
        raise InvalidParameterError("--algorithm grid needs a finite space: give double "
                                    "parameters as categorical lists.")
    if script:
        if search.goal is None:
            raise InvalidParameterError(f"--goal max or --goal min: with --source, say whether "
                                        f"your script's {search.objective} is better high or "
                                        "low.")
        if parse_metrics(f"{search.objective}=1") != {search.objective: 1.0}:
            raise InvalidParameterError(f"--objective {search.objective!r}: Katib's StdOut "
                                        "collector cannot read it; a name is letters, digits, "
                                        "'_', '-' or '|'.")
    elif search.goal and direction(search) != OBJECTIVES[search.objective]:
        raise InvalidParameterError(f"--goal {search.goal}: {search.objective} is "
                                    f"{OBJECTIVES[search.objective]}d; drop --goal.")


class TrainerTrial:
    """One training run for an Optuna trial (a callable: Optuna's objective)."""

    script = False  # check_search's

    def __init__(self, base: TrainConfig, search: Search, nproc: int = 1):
        self.base, self.search, self.out, self.nproc = base, search, Path(base.out), nproc

    def keep(self, number: int, best: Path) -> None:
        """Copy trial `number`'s model directory to `best`."""
        shutil.rmtree(best, ignore_errors=True)
        shutil.copytree(self.out / "trials" / f"trial-{number:04d}", best)

    def command(self, cfg: TrainConfig) -> list:
        if self.nproc == 1:
            return [sys.executable, "-m", "kfvision.trainer.train", *train_flags(cfg)]
        return [sys.executable, "-m", "kfvision.trainer.launch", "--standalone",
                f"--nproc-per-node={self.nproc}", "-m", "kfvision.trainer.train", *train_flags(cfg)]

    def __call__(self, trial) -> float:
        import optuna

        values = {p.name: p.suggest(trial) for p in self.search.params}
        folder = self.out / "trials" / f"trial-{trial.number:04d}"
        cfg = apply(self.base, {**values, "out": str(folder)})
        start, pruned = time.perf_counter(), False
        with open(f"{folder}.log", "w", encoding="utf-8") as logfile, subprocess.Popen(
                self.command(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
            for line in proc.stdout:
                logfile.write(line)
                metrics = parse_metrics(line)
                if self.search.objective in metrics and "epoch" in metrics and not pruned:
                    trial.report(metrics[self.search.objective], int(metrics["epoch"]))
                    if self.search.early_stopping == "median" and trial.should_prune():
                        pruned = True
                        proc.terminate()
        trial.set_user_attr("seconds", round(time.perf_counter() - start, 1))
        if pruned:
            raise optuna.TrialPruned()
        if proc.returncode != 0:
            raise failed(f"trial {trial.number} exited with {proc.returncode}; see "
                              f"{folder}.log")
        summary = json.loads((folder / "metrics.json").read_text())
        trial.set_user_attr("best_epoch", summary["best_epoch"])
        return summary["final"][METRICS[self.search.objective]]


def _open_study(search: Search, out: Path, seed: int):
    """The study in out/study.db (created, or re-opened with its interrupted trials re-queued)."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
              if search.early_stopping == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=storage, study_name=STUDY, load_if_exists=True,
                                direction=direction(search),
                                sampler=_sampler(search, seed), pruner=pruner)
    settings = {"objective": search.objective, "params": [p.katib() for p in search.params]}
    if not study.user_attrs:
        study.set_user_attr("settings", settings)
    elif study.user_attrs["settings"] != settings:
        raise InvalidParameterError(f"{out} holds a study of another search "
                                    f"({study.user_attrs['settings']}); give another --out.")
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_user_attr(t._trial_id, "interrupted", True)  # no public id accessor
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
    return study


def counted(study) -> int:
    """Trials that count towards --trials: finished, and not interrupted."""
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
               and not t.user_attrs.get("interrupted") for t in study.get_trials(deepcopy=False))


def run_search(search: Search, out: Path, objective, seed: int = 0) -> dict:
    """Run the search into `out`, each trial through `objective` (a TrainerTrial, or a user's
    script's: pipelines/tune/script.py); returns study.json's contents.

    Raises:
        InvalidParameterError: bad search settings, or `out` holds another search.
    """
    from optuna.trial import TrialState

    check_search(search, objective.script)
    out = Path(out)
    (out / "trials").mkdir(parents=True, exist_ok=True)
    study = _open_study(search, out, seed)
    remaining = search.trials - counted(study)

    def after_trial(study, trial):
        log.info("trial %d %s: %s -> %s %s", trial.number, trial.state.name.lower(),
                 trial.params, search.objective, "-" if trial.value is None else
                 f"{trial.value:.4f}")
        failed = sum(t.state == TrialState.FAIL and not t.user_attrs.get("interrupted")
                     for t in study.get_trials(deepcopy=False))
        if failed > search.max_failed:
            log.warning("%d trials failed (--max-failed %d): stopping", failed, search.max_failed)
            study.stop()

    if remaining > 0:
        log.info("%d trial(s) to run (%d done), %d at a time", remaining,
                 search.trials - remaining, search.parallel)
        study.optimize(objective, n_trials=remaining,
                       n_jobs=search.parallel, catch=(TrialFailed,),
                       callbacks=[after_trial])
    summary = write_outputs(study, search, out)
    best = summary.get("best")
    if best is not None:
        objective.keep(best["number"], out / "best")
    return summary
