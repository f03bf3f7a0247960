"""Projects as people package them: requirements that point into the snapshot, `src/` layouts,
Hugging Face Trainer's lines, progress bars in the log, the folders a script leaves behind.

The boot tests run the real boot (`--launcher python`: one process, no torchrun) on a snapshot
of a `src/` package, pip installing it per job; the rest read files and lines in process."""

from pathlib import Path

import pytest

from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.metriclines import progress_pairs
from kfvision.pipelines.jobs.progress import Progress
from kfvision.pipelines.script import boot, collect, entry, requirements
from kfvision.pipelines.script.redraws import Redraws, last_state
from kfvision.pipelines.script.snapshot import CACHEDIR_TAG, InvalidSourceError, pack, tag_made


def tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --- requirements read against their own folder ---

def test_local_lines_are_split_from_third_party_and_resolved_in_their_folder(tmp_path):
    root = tree(tmp_path / "src", {
        "requirements.txt": "numpy>=1 # a comment\n-e .\n-r deps/more.txt\n-c deps/pins.txt\n"
                            "--extra-index-url https://example.org/simple\n",
        "deps/more.txt": "./../libs/x[fast]\nfile:../libs/y\nz @ file:../libs/z\n"
                         "-e git+https://example.org/r.git#egg=r\n",
        "deps/pins.txt": "numpy<3\n"})
    reqs = requirements.read(root / "requirements.txt", root)
    assert reqs.third_party == ("numpy>=1", "-e git+https://example.org/r.git#egg=r",
                                "--extra-index-url https://example.org/simple")
    assert reqs.constraints == ("numpy<3",)
    top = root.resolve()
    assert [(x.written, x.line) for x in reqs.local] == [
        ("-e .", f"-e {top}"), ("./../libs/x[fast]", f"{top / 'libs/x'}[fast]"),
        ("file:../libs/y", str(top / "libs/y")),
        ("z @ file:../libs/z", f"z @ {(top / 'libs/z').as_uri()}")]
    assert reqs.files == ("requirements.txt", "deps/more.txt", "deps/pins.txt")


def test_a_path_out_of_the_snapshot_is_refused(tmp_path):
    root = tree(tmp_path / "src", {"requirements.txt": "-e ../elsewhere\n"})
    with pytest.raises(InvalidSourceError, match="points outside the packed source"):
        requirements.read(root / "requirements.txt", root)


@pytest.mark.parametrize("line, ok", [("torch==2.5.1", False), ("torchvision<0.10", False),
                                      ("torch>=2", True), ("torch", True), ("numpy==1.0", True),
                                      ("Torch==9 ; python_version < '3'", False)])
def test_a_requirement_the_images_pins_cannot_meet_is_refused(line, ok):
    pins = {"torch": "2.14.1+cpu", "torchvision": "0.29.1"}
    if ok:
        requirements.check_pins([line], pins, "requirements.txt")
        return
    with pytest.raises(InvalidSourceError) as e:
        requirements.check_pins([line], pins, "requirements.txt")
    assert "--image" in str(e.value) and "--no-check-requirements" in str(e.value)


def test_render_refuses_a_pinned_torch_and_the_flag_skips_it(tmp_path, capsys):
    from kfvision.pipelines.cli import main

    src = tree(tmp_path / "p", {"train.py": "", "requirements.txt": "torch==2.5.1\n"})
    argv = ["job", "render", "--name", "t", "--image", "local", "--source", str(src),
            "--entry", "train.py", "-o", str(tmp_path / "job.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'torch==2.5.1' cannot be met in the image, which has torch" in err
    assert main([*argv, "--no-check-requirements"]) == 0


# --- src/ layouts ---

SRC_PROJECT = {
    "pyproject.toml": '[build-system]\nrequires = ["setuptools>=61"]\n'
                      'build-backend = "setuptools.build_meta"\n\n'
                      '[project]\nname = "mypkg"\nversion = "0.1"\n',
    "src/mypkg/__init__.py": "VERSION = 'v1'\n",
    "src/mypkg/train.py": "import mypkg\nprint('mypkg', mypkg.VERSION, mypkg.__file__)\n",
    "requirements.txt": "-e .\n"}


def test_module_is_looked_for_where_python_m_finds_it(tmp_path):
    files = ["pyproject.toml", "src/mypkg/__init__.py", "src/mypkg/train.py",
             "tools/run.py", "requirements.txt"]
    assert entry.package_folder(files) == "src"
    assert entry.module_roots(files, "tools") == ["tools", "", "src"]
    got = entry.resolve(files, source="p", module="mypkg.train", workdir="tools")
    assert got["requirements"] == "requirements.txt"
    assert entry.resolve(files, source="p", entry="src/mypkg/train.py")["requirements"] == \
        "requirements.txt"  # the root's, none beside the entry
    with pytest.raises(InvalidJobError, match="looked in tools/ or ./ or src/"):
        entry.resolve(files, source="p", module="nothere", workdir="tools")
    flat = ["train/main.py", "train/__init__.py"]
    assert entry.package_folder(flat) is None
    with pytest.raises(InvalidJobError):
        entry.resolve([*flat, "sub/x.py"], source="p", module="main", workdir="sub")


def _boot(tmp_path, project: Path, name: str, *target) -> tuple:
    snap = pack(project)
    archive = tmp_path / f"{name}.tar.gz"
    archive.write_bytes(snap.data)
    code = boot.main(["--sha256", snap.sha256, "--snapshot", str(archive), *target,
                      "--launcher", "python", "--work", str(tmp_path / "w" / name)])
    return code, snap


def _said(capfd) -> tuple:
    got = capfd.readouterr()
    printed = [line.split("] ", 1)[1] for line in got.out.splitlines() if "mypkg " in line]
    return printed, got.err


@pytest.mark.slow  # pip builds the package in every job: 68 s for the 4 jobs here (load ~20)
def test_each_job_imports_its_own_packed_package_never_a_cached_or_live_one(
        tmp_path, capfd, monkeypatch):
    """`-e .` run from a folder outside the project, then from inside it after an edit, then
    `.` after another edit, then a second project with the same requirements text: each job
    prints the version and the file of the package it imported, which must be its own
    snapshot's (under its own WORK)."""
    one = tree(tmp_path / "one", SRC_PROJECT)
    two = tree(tmp_path / "two", {**SRC_PROJECT, "src/mypkg/__init__.py": "VERSION = 'two'\n"})
    runs = [("outside", tmp_path, one, "-e .\n", None, "v1"),
            ("inside-edited", one, one, "-e .\n", "v2", "v2"),
            ("plain-edited", one, one, ".\n", "v3", "v3"),
            ("other", tmp_path, two, ".\n", None, "two")]
    for name, cwd, project, line, edit, version in runs:
        monkeypatch.chdir(cwd)
        (project / "requirements.txt").write_text(line)
        if edit:
            (project / "src/mypkg/__init__.py").write_text(f"VERSION = {edit!r}\n")
        code, _ = _boot(tmp_path, project, name, "--module", "mypkg.train")
        printed, err = _said(capfd)
        assert code == 0, err[-3000:]
        work = tmp_path / "w" / name
        assert len(printed) == 1 and printed[0].startswith(f"mypkg {version} "), (name, printed)
        assert Path(printed[0].split()[2]).resolve().is_relative_to(work.resolve()), \
            (name, printed)
        assert "from the snapshot, installed for this job" in err
    caches = list(Path(tmp_path / "w").glob("*/envs/*/lib/python*/site-packages/mypkg*"))
    assert caches == []  # no job's package went into a shared environment


def test_an_entry_in_src_imports_its_package_and_uses_the_roots_requirements(tmp_path, capfd):
    project = tree(tmp_path / "p", {**SRC_PROJECT, "requirements.txt": "# nothing\n"})
    code, _ = _boot(tmp_path, project, "entry", "--entry", "src/mypkg/train.py")
    printed, err = _said(capfd)
    assert code == 0, err[-3000:]
    assert printed[0].startswith("mypkg v1 ")
    assert "requirements: requirements.txt: no third-party package" in err
    assert "on the script's path:" in err and "/src (from the snapshot)" in err


# --- kfvision's own files are never packed ---

def test_folders_kfvision_made_and_the_jobs_own_files_are_not_packed(tmp_path):
    project = tree(tmp_path / "p", {"train.py": "", "build/jobs/a.yaml": "x",
                                    "build/jobs/a/log.txt": "x", "job.yaml": "x",
                                    "logs/x.txt": "x", "build/keep.txt": "mine"})
    tag_made(project / "build" / "jobs")
    snap = pack(project, exclude=[project / "job.yaml", project / "logs"])
    assert snap.files == ("build/keep.txt", "train.py")
    assert (project / "build" / "jobs" / CACHEDIR_TAG).read_bytes().startswith(b"Signature: ")


# --- Hugging Face Trainer's lines as progress ---

def test_trainer_dicts_and_size_lines_read_as_progress():
    assert progress_pairs("{'loss': '1.392', 'grad_norm': '3.611', 'learning_rate': '0.0005', "
                          "'epoch': '0.2'}") == {"loss": 1.392, "grad_norm": 3.611,
                                                 "learning_rate": 0.0005, "epoch": 0.2}
    assert progress_pairs("{'eval_loss': 0.5, 'epoch': 1.0, 'note': 'x', 'ok': True}") == \
        {"eval_loss": 0.5, "epoch": 1.0}
    assert progress_pairs("  Num Epochs = 3") == {"num_train_epochs": 3}
    assert progress_pairs("  Total optimization steps = 1,200") == {"max_steps": 1200}
    assert progress_pairs("{'a': 1") == {} and progress_pairs("{__import__('os')}") == {}
    assert progress_pairs("epoch=2 loss=0.5") == {"epoch": 2, "loss": 0.5}
    p = Progress()
    for t, line in enumerate(["  Num Epochs = 2", "{'loss': '1.0', 'epoch': '0.5'}",
                              "{'loss': '0.5', 'epoch': '1.0'}"]):
        p.feed(line, 100.0 + t)
    snap = p.snapshot(103.0)
    assert (snap["position"], snap["total"], snap["percent"]) == ("epoch", 2, 50)
    assert snap["metrics"] == {"loss": 0.5, "epoch": 1}


# --- progress bars in the log ---

def test_a_bars_redraws_are_kept_as_their_last_state_every_few_seconds():
    now = [0.0]
    bars = Redraws(every_s=5.0, clock=lambda: now[0])
    out = []
    for i, t in zip(range(1, 11), [0, 1, 2, 3, 6, 7, 8, 9, 9.5, 9.9], strict=True):
        now[0] = t
        out += bars.feed(f"[0/0] {i * 10:3d}%|{'#' * i:<10}| {i}/10 [00:0{i}<00:00, 1it/s]")
        out += bars.feed(f"[0/1] {i * 10:3d}%|{'#' * i:<10}| {i}/20") if i < 3 else []
    out += bars.feed("[0/0] done")
    out += bars.flush()
    assert [line.split("| ")[1].split(" ")[0] if "|" in line else line for line in out] == [
        "1/10", "1/20", "5/10", "10/10", "[0/0] done", "2/20"]
    assert last_state("  5%|#\r 10%|##\r") == " 10%|##"


# --- folders left in the pod ---

def test_folders_the_script_wrote_beside_itself_are_named_or_collected(tmp_path):
    cwd = tree(tmp_path / "src", {"train.py": ""})
    (cwd / "outputs").mkdir()
    before = collect.entries(cwd)
    tree(cwd, {"vit-tiny-shapes/a.bin": "x" * 1500, "vit-tiny-shapes/b/c.json": "{}",
               "runs/ev.txt": "e", "outputs/o.txt": "o"})
    said = []
    kept = collect.collect(cwd, ["runs", "missing"], cwd / "outputs", said.append)
    assert kept == ["runs"] and (cwd / "outputs/runs/ev.txt").is_file()
    left = collect.made(cwd, before, cwd / "outputs", kept)
    assert left == [("vit-tiny-shapes", 2, 1502)]
    collect.say_left(left, said.append)
    assert "vit-tiny-shapes/: 2 files, 1.5 kB, left in the pod (not collected)" in said
    assert any("--collect vit-tiny-shapes" in s and "--output_dir outputs/" in s for s in said)
    with pytest.raises(InvalidSourceError):
        collect.check_collect("../up")



CONSOLE = {**SRC_PROJECT, "pyproject.toml": SRC_PROJECT["pyproject.toml"] +
           '\n[project.scripts]\ntrain-it = "mypkg.train:main"\n'}


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("target, boot_args", [
    (["--module", "mypkg.train"], ["--module", "mypkg.train"]),
    (["--entry", "src/mypkg/train.py"], ["--entry", "src/mypkg/train.py"]),
    (["--console-script", "train-it"], ["--module", "mypkg.train", "--call", "main",
                                        "--console-script", "train-it"])])
def test_a_src_project_renders_three_ways_as_both_kinds(tmp_path, kind, target, boot_args):
    import yaml

    from kfvision.pipelines.cli import main

    src = tree(tmp_path / "p", CONSOLE)
    extra = ["--runtime", "kfvision-torch"] if kind == "trainjob" else []
    assert main(["job", "render", "--name", "s", "--image", "local", "--kind", kind, *extra,
                 "--nodes", "2", "--nproc-per-node", "2", "--source", str(src), *target,
                 "--collect", "runs", "-o", str(tmp_path / "job.yaml")]) == 0
    job = list(yaml.safe_load_all((tmp_path / "job.yaml").read_text()))[-1]
    text = " ".join(str(a) for a in _args(job))
    assert " ".join(boot_args) in text
    assert "--requirements requirements.txt" in text and "--collect runs" in text


def _args(job: dict) -> list:
    if job["kind"] == "PyTorchJob":
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        return pod["containers"][0]["args"]
    return job["spec"]["trainer"]["args"]


def test_a_console_script_that_is_not_declared_names_the_ones_that_are(tmp_path):
    src = tree(tmp_path / "p", CONSOLE)
    assert entry.console_script(src, "train-it") == ("mypkg.train", "main")
    with pytest.raises(InvalidJobError, match=r"not in \[project.scripts\].*it has: train-it"):
        entry.console_script(src, "nope")


@pytest.mark.parametrize("gpus, env, has_accelerate, expected", [
    (0, {}, True, "true"),             # no GPU, Accelerate there: one model across the processes
    (0, {"ACCELERATE_USE_CPU": "false"}, True, "false"),  # the user's value wins
    (1, {}, True, None),               # GPUs: Accelerate picks them itself
    (0, {}, False, None),              # no Accelerate in the script's environment: nothing set
])
def test_accelerate_is_told_to_use_the_cpu_only_where_it_would_train_alone(
        monkeypatch, gpus, env, has_accelerate, expected):
    """The decision of the boot's ACCELERATE_USE_CPU default; the 2 x 2 Trainer run that shows
    what it changes is in `make test-stress` (test_script_trainer.py). The probe of the script's
    interpreter is replaced: its own result decides nothing else."""
    import types

    from kfvision.pipelines.script import prepare

    monkeypatch.setattr(prepare, "uses_accelerate", lambda python: has_accelerate)
    said = []
    env = dict(env)
    prepare.cpu_accelerate(types.SimpleNamespace(gpus=gpus), env, "python", said.append)
    assert env.get("ACCELERATE_USE_CPU") == expected
    assert bool(said) == (expected == "true")  # said only when kfvision set it
