"""Tuning a user's own script (docs/scripts.md, "Tuning a script"): a trial's values reach the
script through placeholders in its arguments, and its objective comes back from the script's own
`NAME=VALUE` lines on standard output, read as Katib's StdOut collector reads them.

    kfvision tune run --source proj --entry train.py --param lr=double:0.001:0.5:log \\
        --objective accuracy --goal max --out tuning/ -- --lr {lr} --epochs 3

A placeholder is `{NAME}` for a searched `--param NAME=...`, anywhere in an argument (`--lr={lr}`
too); in a Katib trial template it becomes `${trialParameters.NAME}`. A placeholder that names no
searched parameter, and a searched parameter that no argument uses, are refused before anything
runs.

The objective of a trial is what Katib records with its default metric strategy (v0.19.0
pkg/apis/controller/experiments/v1beta1/experiment_defaults.go setDefaultObjective): the highest
value printed when maximizing, the lowest when minimizing, over every line of node 0's log (the
primary container's). A script that printed none fails its trial (Katib records the objective as
`unavailable`); the search goes on.
"""

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

from kfvision.pipelines.jobs.errors import JobFailedError
from kfvision.pipelines.jobs.kinds import PYTORCHJOB
from kfvision.pipelines.script.manifest import OUTPUT_ANNOTATION, build_script_job
from kfvision.pipelines.tune.experiment import (
    TRIAL_NAME,
    Search,
    Template,
    TrialKind,
    direction,
    param_ref,
)
from kfvision.pipelines.tune.space import NAME
from kfvision.pipelines.tune.study import failed, parse_metrics
from kfvision.trainer.errors import InvalidParameterError

PLACEHOLDER = re.compile(r"\{(" + NAME.pattern + r")\}")


def check_placeholders(args, params) -> None:
    """Refuse a placeholder of `args` that names no parameter of `params`, and a parameter that
    no argument uses."""
    searched = [p.name for p in params]
    if len(set(searched)) != len(searched):
        twice = next(n for n in searched if searched.count(n) > 1)
        raise InvalidParameterError(f"--param {twice} is given twice.")
    used = set()
    for arg in args:
        for name in PLACEHOLDER.findall(arg):
            if name not in searched:
                raise InvalidParameterError(
                    f"the script argument {arg!r} names {{{name}}}, which no --param searches "
                    f"(searched: {', '.join(searched)}); add --param {name}=TYPE:SPEC or fix "
                    "the name.")
            used.add(name)
    unused = [n for n in searched if n not in used]
    if unused:
        raise InvalidParameterError(
            f"--param {unused[0]} is searched but no script argument uses it: write "
            f"{{{unused[0]}}} where its value goes, after -- (e.g. -- --{unused[0]} "
            f"{{{unused[0]}}}).")


def fill(args, values: dict) -> tuple:
    """`args` with each `{NAME}` replaced by `values[NAME]` (a string as given to the script)."""
    return tuple(PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), a) for a in args)


def objective_of(lines, search: Search) -> float | None:
    """The trial's objective from its log `lines` (module docstring), or None if never printed."""
    values = [m[search.objective] for m in map(parse_metrics, lines) if search.objective in m]
    if not values:
        return None
    return max(values) if direction(search) == "maximize" else min(values)


# --- the Katib trial template -------------------------------------------------------------------


def trial_spec(job: dict, kind: TrialKind, params) -> dict:
    """A rendered script job (named as long as a trial) as Katib's trialSpec: no name or
    namespace, the trial's own name wherever the job's name was (the pods' host names, the
    checkpoint folder on the PVC, the MLflow tag), `{NAME}` in the script's arguments as
    `${trialParameters.NAME}`, and --output-uri one folder further down per trial."""
    name, trial = job["metadata"]["name"], param_ref(TRIAL_NAME)
    spec = json.loads(json.dumps(job).replace(name, trial))
    for key in ("name", "namespace"):
        spec["metadata"].pop(key, None)
    for args in kind.trainer_args(spec):
        cut = args.index("--")  # the boot's own arguments, then the script's
        for i, arg in enumerate(args):
            if i > cut:
                args[i] = PLACEHOLDER.sub(lambda m: param_ref(m.group(1)), arg)
            elif i > 0 and args[i - 1] == "--output-uri":
                args[i] = f"{arg.rstrip('/')}/{trial}"
    annotations = spec["metadata"].get("annotations", {})
    if OUTPUT_ANNOTATION in annotations:
        annotations[OUTPUT_ANNOTATION] = f"{annotations[OUTPUT_ANNOTATION].rstrip('/')}/{trial}"
    return spec


SCRIPT = Template(spec=trial_spec, describe=lambda p: f"{{{p.name}}} in the script's arguments",
                  metrics=lambda search: [])


# --- on this machine ----------------------------------------------------------------------------


class ScriptTrial:
    """One local run of a user's script job for an Optuna trial, as `kfvision job run-local`
    runs it (pipelines/jobs/pytorchjob/local.py): the job is rendered per trial, named
    trial-NNNN, with the trial's values in the script's arguments; its pods' folders and logs
    in OUT/trials/trial-NNNN/."""

    script = True  # check_search's

    def __init__(self, cfg, script, snap, transport, search: Search, out: Path):
        check_placeholders(script.args, search.params)
        self.cfg, self.script, self.snap, self.transport = cfg, script, snap, transport
        self.search, self.out = search, Path(out)

    def folder(self, number: int) -> Path:
        return self.out / "trials" / f"trial-{number:04d}"

    def job(self, number: int, values: dict) -> list:
        """[ConfigMap (if any), job] of trial `number`."""
        name = self.folder(number).name
        script = dataclasses.replace(self.script, args=fill(self.script.args, values))
        if script.output_uri:
            script = dataclasses.replace(script, output_uri=f"{script.output_uri.rstrip('/')}/"
                                                            f"{name}")
        return build_script_job(dataclasses.replace(self.cfg, name=name), script, self.snap,
                                self.transport, PYTORCHJOB)

    def __call__(self, trial) -> float:
        from kfvision.pipelines.jobs.render import run_local

        values = {p.name: p.suggest(trial) for p in self.search.params}
        folder = self.folder(trial.number).absolute()  # the pods' paths: the script runs elsewhere
        docs = self.job(trial.number, values)
        maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted trial's, run again
        start = time.perf_counter()
        try:
            run_local(docs[-1], folder, source=f"trial {trial.number}", quiet=True,
                      config_maps=maps)
        except JobFailedError as e:
            raise failed(f"trial {trial.number}: {str(e).splitlines()[0]}") from e
        finally:
            trial.set_user_attr("seconds", round(time.perf_counter() - start, 1))
        log = folder / f"{PYTORCHJOB.primary}.log"
        value = objective_of(log.read_text(encoding="utf-8").splitlines(), self.search)
        if value is None:
            raise failed(f"trial {trial.number}: the script printed no "
                              f"{self.search.objective}=VALUE line (Katib would record it as "
                              f"unavailable); see {log}")
        return value

    def keep(self, number: int, best: Path) -> None:
        """Copy trial `number`'s model and outputs folders (node 0's) to best/model, best/outputs,
        as `kfvision job download` names them."""
        from kfvision.pipelines.jobs.outputs import local_run, result_folders

        work = local_run(self.folder(number).name, self.folder(number))
        shutil.rmtree(best, ignore_errors=True)
        best.mkdir(parents=True)
        for name, sub in result_folders(work).items():
            if (work / sub).is_dir():
                shutil.copytree(work / sub, best / name)
