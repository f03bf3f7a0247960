"""A user's own script: packing, render (ConfigMap + PyTorchJob/TrainJob, checked
against the upstream schemas and rules), the pod-side boot, and local runs of scripts written in
the three styles users bring (tests/script/styles/), each unchanged."""

import base64
import copy
import json
import os
import random
import tarfile
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.jobstatus import local_status
from helpers.k8s_checks import crd_schema, job_pods, restricted_problems, unknown_fields
from helpers.paths import REPO
from kfvision.pipelines import contract
from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.trainjob.rules import PET_NAMES, validate_trainjob
from kfvision.pipelines.script import boot, env
from kfvision.pipelines.script.snapshot import ignored, pack, parse_ignore, unpack

SCRIPTS = REPO / "tests" / "script" / "styles"
IMAGE = "registry.example.com/kfvision:0.1"


def tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def render(tmp_path, *argv, out="job.yaml") -> list:
    path = tmp_path / out
    script = ["--", *argv[-1]] if argv[-1] else []
    assert main(["job", "render", "--name", "demo", "--image", IMAGE, *argv[:-1], "-o",
                 str(path), *script]) == 0
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# --- packing ---

def test_same_tree_same_bytes_and_a_changed_file_changes_the_hash(tmp_path):
    files = {"train.py": "print(1)\n", "pkg/util.py": "X = 1\n", "data/a.txt": "a" * 1000}
    a, b = tree(tmp_path / "a", files), tree(tmp_path / "b", dict(reversed(files.items())))
    os.utime(b / "train.py", (1, 1))  # times, owners and creation order do not count
    (b / "train.py").chmod(0o600)
    first, second = pack(a), pack(b)
    assert first.data == second.data and first.sha256 == second.sha256
    (b / "pkg/util.py").write_text("X = 2\n")
    assert pack(b).sha256 != first.sha256
    (b / "pkg/util.py").write_text("X = 1\n")
    (b / "train.py").chmod(0o700)  # the executable bit is content
    assert pack(b).sha256 != first.sha256
    dest = tmp_path / "out"
    assert sorted(unpack(first.data, dest)) == sorted(files)
    assert (dest / "data/a.txt").read_text() == "a" * 1000


def test_ignore_files_git_and_byte_code_are_left_out(tmp_path):
    root = tree(tmp_path, {
        "train.py": "", ".gitignore": "*.log\nbuild/\n/top.txt\n!keep.log\n",
        "a.log": "", "keep.log": "", "top.txt": "", "sub/top.txt": "", "build/x": "",
        "sub/.kfvisionignore": "big/\n*.bin\n", "sub/big/w": "", "sub/w.bin": "",
        "sub/ok.py": "", ".git/HEAD": "", "pkg/__pycache__/m.pyc": "", "pkg/m.py": "",
        "deep/a/b/c.ckpt": "", ".kfvisionignore": "deep/**/*.ckpt\n"})
    assert pack(root).files == (".gitignore", ".kfvisionignore", "keep.log",
                                "pkg/m.py", "sub/.kfvisionignore", "sub/ok.py", "sub/top.txt",
                                "train.py")


@pytest.mark.parametrize("pattern,path,is_dir,verdict", [
    ("*.py", "a/b.py", False, True),
    ("/b.py", "a/b.py", False, False),
    ("a/*.py", "a/b.py", False, True),
    ("a/*.py", "x/a/b.py", False, False),
    ("**/b.py", "x/y/b.py", False, True),
    ("a/**", "a/x/y", False, True),
    ("a/**/z", "a/z", False, True),
    ("out/", "out", False, False),
    ("out/", "out", True, True),
    ("b?.txt", "b1.txt", False, True),
    ("[ab].txt", "c.txt", False, False),
    ("[!ab].txt", "c.txt", False, True),
    ("\\#x", "#x", False, True),
])
def test_the_gitignore_matcher(pattern, path, is_dir, verdict):
    assert ignored(parse_ignore(pattern), path, is_dir) is verdict


def test_secret_looking_files_are_left_out_unless_named(tmp_path, capsys):
    key = json.dumps({"type": "service_account", "private_key": "-----BEGIN"})
    root = tree(tmp_path / "src", {"train.py": "", ".env": "A=1", "certs/tls.key": "k",
                                   "id_rsa": "k", "id_rsa.pub": "p", ".aws/credentials": "c",
                                   ".netrc": "n", "sa.json": key, "conf.json": "{}"})
    snap = pack(root)
    assert snap.files == ("conf.json", "train.py")
    assert snap.left_out == (".aws/credentials", ".env", ".netrc", "certs/tls.key", "id_rsa",
                             "id_rsa.pub", "sa.json")
    assert pack(root, include=[".env"]).files == (".env", "conf.json", "train.py")
    docs = render(tmp_path, "--source", str(root), "--entry", "./train.py", [])
    args = docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--entry") + 1] == "train.py"
    err = capsys.readouterr().err
    assert "left out as secrets: .aws/credentials, .env, .netrc, certs/tls.key" in err
    with pytest.raises(Exception, match="--include-secret nope is not a file"):
        pack(root, include=["nope"])


# --- render ---

def _docs_of(tmp_path, kind, *extra, script=("--epochs", "2", "--", "a b", "")):
    src = SCRIPTS / "torchrun_ddp"
    return render(tmp_path, "--kind", kind, *(["--runtime", "kfvision-torch"] if kind ==
                                                "trainjob" else []),
                  "--nodes", "2", "--nproc-per-node", "2", "--pvc", "data:/data",
                  "--source", str(src), "--entry", "train.py", "--input", "train=pvc://data/d",
                  "--output-uri", "s3://bucket/run1", *extra, list(script))


@pytest.mark.parametrize("kind,crd", [
    ("pytorchjob", ("kubeflow.org_pytorchjobs.yaml",)),
    ("trainjob", ("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")),
])
def test_rendered_configmap_and_job_pass_the_upstream_checks(tmp_path, kind, crd):
    cm, job = _docs_of(tmp_path, kind)
    schema = crd_schema(*crd)
    jsonschema.validate(job, schema)
    assert unknown_fields(job, schema) == []
    kubernetes_validate.validate(cm, "1.30", strict=True)
    assert cm["immutable"] is True and cm["metadata"]["name"].endswith(
        job["metadata"]["annotations"]["kfvision.dev/source-sha256"])
    data = base64.b64decode(cm["binaryData"]["source.tar.gz"])
    assert pack(SCRIPTS / "torchrun_ddp").data == data
    for pod in job_pods(job):
        assert restricted_problems(pod) == []
        assert {"name": "kfvision-source", "configMap": {"name": cm["metadata"]["name"]}} in \
            pod["volumes"]
    if kind == "pytorchjob":
        for r in job["spec"]["pytorchReplicaSpecs"].values():
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": "p"}, "spec": r["template"]["spec"]}, "1.30", strict=True)
        args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"][0]["args"]
    else:
        args = job["spec"]["trainer"]["args"]
        assert not {e["name"] for e in job["spec"]["trainer"]["env"]} & set(PET_NAMES)
    # everything after -- reaches the script as it was given, a second -- and '' included
    assert args[args.index("--") + 1:] == ["--epochs", "2", "--", "a b", ""]
    assert args[args.index("--input") + 1] == "train=/data/d"
    assert args[args.index("--state") + 1] == "/data/kfvision/demo"


def test_a_configmap_too_big_for_client_side_apply_says_how_to_apply_it(tmp_path, capsys):
    root = tree(tmp_path / "src", {"train.py": "", "w.bin": random.Random(3).randbytes(400_000)})
    render(tmp_path, "--source", str(root), "--entry", "train.py", [])
    err = capsys.readouterr().err
    assert "is too big for client-side `kubectl apply`" in err
    assert "# Rendered by kfvision from your own script: `kubectl apply --server-side -f`" in \
        (tmp_path / "job.yaml").read_text()
    render(tmp_path, "--source", str(SCRIPTS / "sagemaker_style"), "--entry", "train.py", [])
    assert "client-side" not in capsys.readouterr().err


def test_a_scripts_trainjob_references_the_runtime_kind_it_was_given(tmp_path):
    """--runtime-kind TrainingRuntime (a namespaced runtime), as the built-in trainer's job takes
    it: the script's TrainJob once referenced a ClusterTrainingRuntime whatever was given."""
    (job,) = _docs_of(tmp_path, "trainjob", "--source-pvc", "/data/src", "--runtime-kind",
                      "TrainingRuntime")
    assert job["spec"]["runtimeRef"] == {"name": "kfvision-torch",
                                         "apiGroup": "trainer.kubeflow.org",
                                         "kind": "TrainingRuntime"}
    (job,) = _docs_of(tmp_path, "trainjob", "--source-pvc", "/data/src")
    assert job["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"


def test_a_trainjob_with_pet_names_in_trainer_env_is_refused(tmp_path):
    (job,) = _docs_of(tmp_path, "trainjob", "--source-pvc", "/data/src")
    broken = copy.deepcopy(job)
    broken["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    with pytest.raises(InvalidJobError, match="trainer.env sets PET_NNODES"):
        validate_trainjob(broken)


def test_a_big_tree_goes_to_the_store_and_is_uploaded_once(tmp_path, monkeypatch):
    from kfvision.pipelines.clients import s3, s3put

    root = tree(tmp_path / "src", {"train.py": "", "w.bin": random.Random(1).randbytes(900_000)})
    uploads, present = [], set()
    monkeypatch.setattr(s3, "head", lambda uri: object() if uri in present else None)
    monkeypatch.setattr(s3put, "upload", lambda path, b, k: (uploads.append(f"s3://{b}/{k}"),
                                                             present.add(f"s3://{b}/{k}")))
    for _ in range(2):
        docs = render(tmp_path, "--source", str(root), "--entry", "train.py",
                      "--source-store", "s3://bucket/src/", [])
    sha = pack(root).sha256
    assert [d["kind"] for d in docs] == ["PyTorchJob"]
    assert uploads == [f"s3://bucket/src/{sha}.tar.gz"]


@pytest.mark.parametrize("files,argv,message", [
    ({"train.py": ""}, ["--entry", "missing.py"],
     "InvalidJobError: --entry missing.py is not in --source"),
    ({"train.py": "", ".gitignore": "train.py\n"}, ["--entry", "train.py"],
     ".gitignore/.kfvisionignore leaves it out"),
    ({"train.py": "", "w.bin": "BIG"}, ["--entry", "train.py"],
     "InvalidJobError: the source snapshot is too big for a ConfigMap: 2 files, 1.17 MiB "
     "packed, 1.56 MiB as base64 (limit 1.00 MiB); give --source-store"),
    ({"train.py": ""}, ["--entry", "train.py", "--kind", "trainjob", "--env", "PET_NNODES=3"],
     "InvalidJobError: --env PET_NNODES: the platform sets it (Kubeflow Trainer's webhook "
     "refuses PET_NNODES"),
    ({"train.py": ""}, ["--entry", "train.py", "--epochs", "3"],
     "InvalidJobError: --epochs is a flag of the built-in trainer"),
    ({"train.py": ""}, ["--entry", "train.py", "--launcher", "python", "--nproc-per-node", "2"],
     "InvalidJobError: --launcher python runs one process per pod"),
    ({"train.py": ""}, ["--entry", "train.py", "--input", "d=pvc://nope/x"],
     "claim 'nope' is not mounted"),
    ({"train.py": ""}, ["--module", "pkg.main"], "--module pkg.main is not in --source"),
    ({"src/train.py": ""}, ["--entry", "src/train.py", "--workdir", "data"],
     "InvalidJobError: --workdir data is not a folder of --source"),
    ({"src/train.py": ""}, ["--entry", "src/train.py", "--workdir", "../src"],
     "InvalidJobError: --workdir ../src is not a folder of --source"),
])
def test_bad_input_is_one_named_line_and_nothing_is_written(tmp_path, capsys, files, argv,
                                                            message):
    if files.get("w.bin") == "BIG":
        files = {**files, "w.bin": random.Random(2).randbytes(1_230_000)}
    root = tree(tmp_path / "src", files)
    out = tmp_path / "job.yaml"
    code = main(["job", "render", "--name", "demo", "--image", IMAGE, "--source", str(root),
                 *argv, "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_render_without_source_still_needs_the_trainer_paths(capsys):
    assert main(["job", "render", "--name", "d", "--image", IMAGE]) == 2
    assert "the following arguments are required: --model, --train, --val, --out" in \
        capsys.readouterr().err
    for flags in (["--launcher", "python"], ["--entry", "t.py"], ["--", "--lr", "1"]):
        assert main(["job", "render", "--name", "d", "--image", IMAGE, *flags]) == 2
        assert "need --source DIR" in capsys.readouterr().err


# --- the boot ---

def _reqs(folder: Path):
    from kfvision.pipelines.script.requirements import read

    return read(folder / "requirements.txt", folder)


def test_a_requirement_that_does_not_exist_is_a_named_error_with_pips_lines(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index: fails at once, the same way
    (tmp_path / "requirements.txt").write_text("no-such-package-kfvision==1.0\n")
    with pytest.raises(env.RequirementsInstallError) as e:
        env.ensure_env(_reqs(tmp_path), tmp_path / "cache", "requirements.txt", say=lambda s: None)
    assert e.value.exit_code == 2
    assert "pip could not install requirements.txt" in str(e.value)
    assert "no-such-package-kfvision" in str(e.value)
    assert list((tmp_path / "cache").glob("*/bin")) == []  # nothing half-built is kept


def test_the_environment_pins_torch_and_a_second_setup_installs_nothing(tmp_path):
    (tmp_path / "requirements.txt").write_text("torch\n")  # a stray torch line: already met
    t = time.monotonic()
    python = env.ensure_env(_reqs(tmp_path), tmp_path / "c", "requirements.txt",
                            say=lambda s: None)
    first = time.monotonic() - t
    t = time.monotonic()
    assert env.ensure_env(_reqs(tmp_path), tmp_path / "c", "requirements.txt",
                          say=lambda s: None) == python
    assert time.monotonic() - t < 0.5 < first
    assert "torch==" in (python.parent.parent / "constraints.txt").read_text()
    assert not list(python.parent.parent.glob("lib/python*/site-packages/torch"))


def test_boot_refuses_a_snapshot_that_changed(tmp_path, capsys):
    snap = pack(tree(tmp_path / "src", {"train.py": ""}))
    (tmp_path / "s.tar.gz").write_bytes(snap.data + b"x")
    code = boot.main(["--sha256", snap.sha256, "--snapshot", str(tmp_path / "s.tar.gz"),
                      "--entry", "train.py", "--work", str(tmp_path / "w")])
    assert code == 2
    assert "InvalidSourceError: the source snapshot" in capsys.readouterr().err


def test_a_script_that_wrote_nothing_to_collect_is_told_so(tmp_path, capsys):
    """pytorch/examples' mnist/main.py saves its weights beside itself: the job succeeds, and the
    boot says that nothing reached --output-uri, and why, instead of copying nothing silently."""
    model, outputs, uri = tmp_path / "model", tmp_path / "outputs", tmp_path / "results"
    model.mkdir(), outputs.mkdir()
    boot.save_outputs(str(uri), {"model": model, "outputs": outputs})
    assert f"nothing to copy to {uri}: the script wrote nothing to the model folder " \
        "(KFVISION_MODEL_DIR) or ./outputs" in capsys.readouterr().err
    assert not uri.exists()
    (outputs / "summary.csv").write_text("epoch\n")
    boot.save_outputs(str(uri), {"model": model, "outputs": outputs})
    assert "outputs: copied to" in capsys.readouterr().err
    assert (uri / "outputs" / "summary.csv").is_file() and not (uri / "model").exists()


@pytest.mark.parametrize("module", [False, True])
def test_a_script_runs_in_its_workdir_and_reads_dot_dot_data(tmp_path, capfd, module):
    """Kubeflow's PyTorchJob MNIST example reads '../data' from its Dockerfile's WORKDIR
    /opt/mnist/src: --workdir src runs it from there, unchanged, the entry still named from the
    source folder; its ./outputs is the one collected."""
    src = tree(tmp_path / "proj", {
        "src/mnist.py": "import os, sys\nprint('cwd', os.path.basename(os.getcwd()), "
                        "open('../data/raw.txt').read(), sys.argv[1:])\n"
                        "os.makedirs('outputs', exist_ok=True)\n"
                        "open('outputs/o.txt', 'w').write('o')\n",
        "src/__init__.py": "", "data/raw.txt": "digits"})
    target = ["--module", "src.mnist"] if module else ["--entry", "src/mnist.py"]
    docs = render(tmp_path, "--source", str(src), *target, "--workdir", "./src", ["a b"])
    args = docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--workdir") + 1] == "src"
    snap = pack(src)
    (tmp_path / "s.tar.gz").write_bytes(snap.data)
    out = tmp_path / "results"
    code = boot.main(["--sha256", snap.sha256, "--snapshot", str(tmp_path / "s.tar.gz"), *target,
                      "--workdir", "src", "--launcher", "python", "--work", str(tmp_path / "w"),
                      "--output-uri", str(out), "--", "a b"])
    got = capfd.readouterr()
    assert code == 0, got.err
    assert got.out.strip() == "[0/0] cwd src digits ['a b']"  # the relay's [node/rank]
    assert (out / "outputs" / "o.txt").read_text() == "o"


# --- local runs of the three styles, each unchanged ---

def _run_local(tmp_path, docs_argv, capsys, kind="pytorchjob", log_dir=None) -> tuple:
    render(tmp_path, "--kind", kind, *(["--runtime", "kfvision-torch"] if kind == "trainjob"
                                       else []), *docs_argv[:-1], docs_argv[-1])
    code = main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir",
                 str(log_dir or tmp_path / "logs")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.distributed
@pytest.mark.slow
def test_a_torchrun_ddp_script_runs_2x2_with_a_requirement_the_image_lacks(tmp_path, capsys,
                                                                           micro_digits):
    out = tmp_path / "results"
    code, log, err = _run_local(tmp_path, ["--nodes", "2", "--nproc-per-node", "2",
                                           "--source", str(SCRIPTS / "torchrun_ddp"),
                                           "--entry", "train.py", "--output-uri", str(out),
                                           "--progress-total", "epochs=2",
                                           ["--data", str(micro_digits["train"]), "--epochs",
                                            "2", "--tag", "HelloWorld"]], capsys)
    assert code == 0, err + log
    for rank in range(4):
        assert f"rank {rank}/4 local_rank {rank % 2} epoch=1" in log
    # what `job status` shows: the total given at render, rank 0's position and metrics
    view = local_status("demo", tmp_path / "logs", capsys)
    assert (view["phase"], view["nodes"], view["procs"]) == ("Succeeded", 2, "2")
    progress = view["progress"]
    assert (progress["position"], progress["done"], progress["total"]) == ("epoch", 2, 2)
    assert progress["percent"] == 100 and set(progress["metrics"]) == {"epoch", "loss"}
    info = json.loads((out / "model" / "info.json").read_text())
    assert info == {"classes": [str(i) for i in range(10)], "tag": "hello_world",
                    "world_size": 4}
    assert (out / "model" / "model.pt").stat().st_size > 0


@pytest.mark.distributed
def test_an_operator_style_script_runs_as_a_trainjob_and_exit_1_is_not_retried(tmp_path,
                                                                               capsys):
    argv = ["--nodes", "2", "--source", str(SCRIPTS / "operator_style"), "--entry", "train.py",
            "--launcher", "python"]
    code, log, err = _run_local(tmp_path, [*argv, ["--steps", "2"]], capsys, kind="trainjob")
    assert code == 0, err + log
    assert "rank 1 of 2 via tcp://127.0.0.1:" in log and "rank 0 done" in log
    view = local_status("demo", tmp_path / "logs", capsys)  # the total printed by the script
    assert (view["kind"], view["phase"], view["nodes"]) == ("TrainJob", "Succeeded", 2)
    progress = view["progress"]
    assert (progress["position"], progress["done"], progress["total"]) == ("step", 2, 2)
    assert list(progress["metrics"]) == ["step", "grad_norm"]
    code, log, err = _run_local(tmp_path, [*argv, ["--exit-code", "1", "--fail-rank", "1"]],
                                capsys)
    assert code == 1
    assert "FAILED: rank 1 on node 1 exited with 1 (unexpected error: permanent)" in err
    assert "restart" not in log
    view = local_status("demo", tmp_path / "logs", capsys)
    assert view["phase"] == "Failed" and view["message"].startswith("job demo failed: ")


@pytest.mark.distributed
def test_a_sagemaker_style_script_gets_its_channels_and_model_dir(tmp_path, capsys,
                                                                  micro_digits, monkeypatch):
    out = tmp_path / "results"
    monkeypatch.chdir(tmp_path)  # a relative --log-dir, as the default build/jobs/NAME is
    code, log, err = _run_local(tmp_path, ["--source", str(SCRIPTS / "sagemaker_style"),
                                           "--entry", "train.py", "--launcher", "python",
                                           "--input", f"train={micro_digits['train']}",
                                           "--output-uri", str(out),
                                           ["--epochs", "2", "--lr", "0.2"]], capsys,
                                log_dir="logs")
    assert code == 0, err + log
    assert "epoch=1 loss=" in log
    view = local_status("demo", "logs", capsys)  # counted from 0: epoch=1 is two done
    assert (view["progress"]["done"], view["progress"]["percent"]) == (2, 100)
    assert (out / "model" / "model.pt").is_file()
    metrics = json.loads((out / "outputs" / "metrics.json").read_text())
    assert metrics["hosts"] == ["demo-master-0"] and metrics["current_host"] == "demo-master-0"
    assert metrics["channels"] == ["train"]
    # the model folder is one kfvision scores (and serves): TorchScript + classes.txt
    scored = tmp_path / "scored.csv"
    assert main(["score", "--model", str(out / "model"), "--data", str(micro_digits["val"]),
                 "--out", str(scored)]) == 0, capsys.readouterr().err
    assert len(scored.read_text().splitlines()) == 1 + 10  # a header and the 10 images


@pytest.mark.distributed
@pytest.mark.slow
def test_object_storage_end_to_end_snapshot_channel_and_results(tmp_path, capsys, s3_bucket,
                                                                micro_digits):
    """The snapshot through --source-store (uploaded once), an s3:// channel fetched by the
    boot, and the model and outputs pushed to an s3:// --output-uri: moto's S3 server."""
    from kfvision.pipelines.clients import s3

    s3_bucket.upload_folder(micro_digits["train"], "digits/")
    argv = ["--source", str(SCRIPTS / "sagemaker_style"), "--entry", "train.py", "--launcher",
            "python", "--source-store", s3_bucket.uri("src"), "--input",
            f"train={s3_bucket.uri('digits/')}", "--output-uri", s3_bucket.uri("run1"),
            ["--epochs", "1"]]
    code, log, err = _run_local(tmp_path, argv, capsys)
    assert code == 0, err + log
    sha = pack(SCRIPTS / "sagemaker_style").sha256
    assert f"uploaded to {s3_bucket.uri('src')}/{sha}.tar.gz" in err
    keys = {o.key for o in s3.list_objects(s3_bucket.uri("run1/"))}
    assert {"run1/model/model.pt", "run1/outputs/metrics.json"} <= keys
    render(tmp_path, *argv[:-1], argv[-1])
    assert f"at {s3_bucket.uri('src')}/{sha}.tar.gz (already there)" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_retried_and_its_checkpoints_are_still_there(
        tmp_path, capsys, micro_digits):
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    render(tmp_path, "--nproc-per-node", "2", "--pvc", f"data:{pvc}", "--source",
           str(SCRIPTS / "torchrun_ddp"), "--entry", "train.py",
           # 2 epochs: the kill lands in the pause after epoch 0, the restart resumes at epoch 1
           ["--data", str(micro_digits["train"]), "--epochs", "2", "--pause", "3"])
    code = main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir",
                 str(tmp_path / "logs"), "--fault", "master-0/1:KILL:rank 0/2 local_rank 0 "
                 "epoch=0"])
    log = capsys.readouterr().out
    assert code == 0, log
    assert "exited with 137 (killed by SIGKILL: retried)" in log or "exit code 137" in log
    assert "--- restart 1 (exit code 137, restartPolicy ExitCode" in log
    assert "rank 0 resumed from epoch 0" in log  # the checkpoint folder outlived the pod
    assert (pvc / "kfvision" / "demo" / "checkpoints" / "last.pt").is_file()


def _fake_cluster_with_config_maps():
    """tests/jobs/test_job_cluster.py's fake API, plus the two ConfigMap calls `submit` makes."""
    from helpers.fake_k8s import RUNNING, FakeCluster
    from kubernetes.client.rest import ApiException

    class Response:
        def __init__(self, body):
            self.data = json.dumps(body).encode()

    class WithConfigMaps(FakeCluster):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.config_maps = {}

        def create_namespaced_config_map(self, namespace, body, _preload_content=True):
            self._serve("create", "configmaps")
            if body["metadata"]["name"] in self.config_maps:
                raise ApiException(status=409, reason="Conflict")
            self.config_maps[body["metadata"]["name"]] = body
            return Response(body)

        def read_namespaced_config_map(self, name, namespace, _preload_content=True):
            self._serve("get", "configmaps")
            return Response(self.config_maps[name])

    return WithConfigMaps([RUNNING])


def test_submit_creates_the_configmap_first_and_reuses_it(tmp_path, monkeypatch, capsys):
    from helpers.fake_k8s import fake_connect
    from kfvision.pipelines.jobs import jobclient

    fake = _fake_cluster_with_config_maps()
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    src = tree(tmp_path / "src", {"train.py": "print('hi')\n"})
    path = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "digits", "--image", IMAGE, "--nodes", "3",
                 "--source", str(src), "--entry", "train.py", "-o", str(path)]) == 0
    for _ in range(2):
        assert main(["job", "submit", str(path)]) == 0
    name = f"kfvision-src-{pack(src).sha256}"
    assert fake.calls[:2] == [("create", "configmaps"), ("create", "pytorchjobs")]
    assert ("get", "configmaps") in fake.calls[2:]
    assert fake.config_maps[name]["immutable"] is True
    assert fake.jobs["digits"]["metadata"]["annotations"] == {
        "kfvision.dev/source-sha256": pack(src).sha256}


def test_job_run_submit_renders_says_where_and_submits(tmp_path, monkeypatch, capsys):
    from helpers.fake_k8s import fake_connect
    from kfvision.pipelines.jobs import jobclient

    fake = _fake_cluster_with_config_maps()
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    monkeypatch.chdir(tmp_path)
    src = tree(tmp_path / "src", {"train.py": "print('hi')\n"})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["job", "run", "--name", "digits", "--image", IMAGE, "--source", str(src),
                 "--entry", "train.py", "--tracking-uri", "http://mlflow.kubeflow:5000",
                 "--experiment", "mnist", "--submit", "--", "--lr", "0.1"]) == 0
    assert "running your script to build/jobs/digits.yaml" in capsys.readouterr().err
    assert (tmp_path / "build" / "jobs" / "digits.yaml").is_file()
    assert fake.calls[:2] == [("create", "configmaps"), ("create", "pytorchjobs")]
    container = fake.jobs["digits"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "spec"]["containers"][0]
    assert container["args"][-3:] == ["--", "--lr", "0.1"]
    env = {e["name"]: e.get("value") for e in container["env"]}  # the script's MLflow run
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.kubeflow:5000"
    assert env["MLFLOW_EXPERIMENT_NAME"] == "mnist"


def test_render_and_the_boot_load_neither_torch_nor_kubernetes(tmp_path):
    import subprocess
    import sys

    src = tree(tmp_path / "src", {"train.py": ""})
    code = ("import sys; from kfvision.pipelines.cli import main; "
            "import kfvision.pipelines.script.boot; "
            f"main(['job', 'render', '--name', 'x', '--image', 'i', '--source', {str(src)!r}, "
            f"'--entry', 'train.py', '-o', {str(tmp_path / 'j.yaml')!r}]); "
            "print(sorted(m for m in ('torch', 'kubernetes', 'boto3') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_job_run_needs_a_source_and_expands_no_abbreviation(capsys):
    with pytest.raises(SystemExit) as e:
        main(["job", "run", "--name", "x", "--image", "i", "--sour", "d"])
    assert e.value.code == 2 and "unrecognized arguments: --sour" in capsys.readouterr().err
    assert main(["job", "run", "--name", "x", "--image", "i"]) == 2
    assert "InvalidJobError: kfvision job run needs --source DIR" in capsys.readouterr().err


def test_the_contract_names_each_folder_under_every_platforms_names():
    env = contract.contract_env(model="/m", outputs="/o", checkpoints="/c", tensorboard="/t",
                                inputs={"train-data": "/d"}, gpus=2, hosts=["h0", "h1"],
                                current_host="h1", sha256="abc")
    assert {k: env[k] for k in ("KFVISION_MODEL_DIR", "SM_MODEL_DIR", "AIP_MODEL_DIR")} == \
        dict.fromkeys(("KFVISION_MODEL_DIR", "SM_MODEL_DIR", "AIP_MODEL_DIR"), "/m")
    assert env["SM_OUTPUT_DATA_DIR"] == env["KFVISION_OUTPUT_DIR"] == "/o"
    assert env["AIP_CHECKPOINT_DIR"] == env["KFVISION_CHECKPOINT_DIR"] == "/c"
    assert env["AIP_TENSORBOARD_LOG_DIR"] == env["KFVISION_TENSORBOARD_DIR"] == "/t"
    assert env["SM_CHANNEL_TRAIN_DATA"] == env["KFVISION_INPUT_TRAIN_DATA"] == "/d"
    assert json.loads(env["SM_CHANNELS"]) == ["train-data"]
    assert (env["SM_NUM_GPUS"], json.loads(env["SM_HOSTS"]), env["SM_CURRENT_HOST"]) == (
        "2", ["h0", "h1"], "h1")


@pytest.mark.distributed
def test_a_snapshot_on_a_pvc_is_written_there_and_read_by_the_pods(tmp_path, capsys):
    pvc = tmp_path / "pvc"
    (pvc / "src").mkdir(parents=True)
    src = tree(tmp_path / "src", {"run.py": "import os, sys\nprint('cwd', os.getcwd(), "
                                            "sys.argv[1:])\n"})
    code, log, err = _run_local(tmp_path, ["--pvc", f"data:{pvc}", "--source", str(src),
                                           "--entry", "run.py", "--launcher", "python",
                                           "--source-pvc", str(pvc / "src"), ["x y"]], capsys)
    assert code == 0, err + log
    sha = pack(src).sha256
    assert (pvc / "src" / f"{sha}.tar.gz").read_bytes() == pack(src).data
    assert "/kfvision/work/src ['x y']" in log
    assert [d["kind"] for d in yaml.safe_load_all((tmp_path / "job.yaml").read_text())] == [
        "PyTorchJob"]


@pytest.mark.parametrize("name,argv", [
    ("script-pytorchjob-2x2", ["--nodes", "2", "--nproc-per-node", "2"]),
    ("script-trainjob-2x1-python", ["--kind", "trainjob", "--runtime", "kfvision-torch",
                                    "--nodes", "2", "--launcher", "python"]),
])
def test_golden_render(name, argv, tmp_path, monkeypatch):
    """The rendered file of a script job, reviewed in diffs (`make golden-jobs` rewrites it)."""
    from helpers.golden import GOLDEN_DIR, UPDATE, assert_same_text

    monkeypatch.chdir(REPO)  # the header names --source as given: relative, the same anywhere
    path = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "mnist", "--image",
                 "registry.example.com/kfvision-trainer:0.1.0", *argv, "--pvc", "data:/data",
                 "--source", "tests/script/styles/torchrun_ddp", "--entry", "train.py", "--input",
                 "train=pvc://data/digits/train", "--output-uri", "s3://models/mnist", "-o",
                 str(path), "--", "--data", "/data/digits/train", "--epochs", "3"]) == 0
    golden = GOLDEN_DIR / f"{name}.yaml"
    if UPDATE:
        golden.write_text(path.read_text())
    assert_same_text(golden, path.read_text(), "make golden-jobs")


@pytest.mark.distributed
def test_a_requirement_pip_cannot_install_fails_the_job_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the pods inherit it here: pip fails at once
    src = tree(tmp_path / "src", {"run.py": "print('never')\n",
                                  "requirements.txt": "no-such-package-kfvision==1.0\n"})
    code, log, err = _run_local(tmp_path, ["--source", str(src), "--entry", "run.py",
                                           "--launcher", "python", []], capsys)
    assert code == 1
    assert "master-0 exited with code 2 (restartPolicy ExitCode does not retry it)" in err
    assert "cause: [0/-] [kfvision script] error: RequirementsInstallError: pip could not " \
        "install requirements.txt" in err
    assert "never" not in log and "restart" not in log


PUBLIC_MNIST = "KFVISION_PUBLIC_MNIST"  # a path to Kubeflow's examples/pytorch/mnist/mnist.py


def _idx_digits(raw: Path) -> None:
    """scikit-learn's digits as torchvision's MNIST raw files (20x20 in a 28x28 frame), so the
    dataset class finds them and downloads nothing."""
    import struct

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    small = (d.images * (255 / 16)).round().astype(np.uint8)
    x = np.zeros((len(small), 28, 28), np.uint8)
    x[:, 4:24, 4:24] = [np.asarray(Image.fromarray(i, "L").resize((20, 20))) for i in small]
    raw.mkdir(parents=True)
    for name, sel in (("train", slice(297, None)), ("t10k", slice(0, 297))):
        n = len(x[sel])
        (raw / f"{name}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) +
                                                        x[sel].tobytes())
        (raw / f"{name}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) +
                                                        d.target[sel].astype(np.uint8).tobytes())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(PUBLIC_MNIST), reason=f"{PUBLIC_MNIST} is not set: the "
                    "path to kubeflow/trainer v1.9.3's examples/pytorch/mnist/mnist.py, fetched "
                    "by hand (its run installs tensorboardX from PyPI); never downloaded here")
def test_kubeflows_public_mnist_example_runs_unchanged_2x2(tmp_path, capsys):
    """A script nobody here wrote, byte for byte, from its Dockerfile's WORKDIR (docs/scripts.md,
    Public scripts run unchanged)."""
    src = tmp_path / "kfmnist"
    (src / "src").mkdir(parents=True)
    (src / "src" / "mnist.py").write_bytes(Path(os.environ[PUBLIC_MNIST]).read_bytes())
    (src / "requirements.txt").write_text("tensorboardX==2.6.2\n")
    _idx_digits(src / "data" / "FashionMNIST" / "raw")
    code, log, err = _run_local(tmp_path, ["--nodes", "2", "--nproc-per-node", "2", "--source",
                                           str(src), "--workdir", "src", "--entry",
                                           "src/mnist.py", "--requirements", "requirements.txt",
                                           ["--epochs", "1", "--no-cuda", "--backend", "gloo"]],
                                capsys)
    assert code == 0, err + log
    for rank in range(4):
        assert f"World Size: 4. Rank: {rank}" in log
    assert log.count("accuracy=") == 4


@pytest.mark.parametrize("name, kind", [("../outside.py", tarfile.REGTYPE),
                                        ("link.py", tarfile.SYMTYPE)])
def test_unpack_refuses_what_the_data_filter_refuses_where_python_lacks_it(tmp_path, monkeypatch,
                                                                           name, kind):
    """Python before 3.10.12 / 3.11.4 has no tarfile.data_filter (Debian bookworm's 3.11.2):
    the same refusals, made by hand."""
    import io

    from kfvision.pipelines.script.snapshot import InvalidSourceError, unpack

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
        tar.addfile(info, io.BytesIO(b""))
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(InvalidSourceError, match=name.replace(".", r"\.")):
        unpack(buf.getvalue(), tmp_path / "src")
    assert not (tmp_path / "outside.py").exists()
