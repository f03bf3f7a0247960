"""A model directory a user's own training script wrote (trainer/model/scripted.py): a small
network saved as TorchScript, torch.export and ONNX with its class names, then scored, served
(with the arguments `kfvision deploy render` gives the container), exported, pushed and
registered as kfvision's own model directory is; and each wrong layout a named error saying what
to write."""

import csv
import json

import pytest
import torch
import yaml
from torch import nn

from kfvision.pipelines.cli import main as cli
from kfvision.pipelines.serve.client import Server, request, v1_body, v2_body
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import Normalizer, eval_transform
from kfvision.trainer.errors import (
    DeviceError,
    ExportNotSupportedError,
    InvalidModelDirectoryError,
    InvalidParameterError,
)
from kfvision.trainer.model.trained import load_model, load_trained_model
from kfvision.trainer.presets import IMAGENET_MEAN, IMAGENET_STD

CLASSES = [str(i) for i in range(10)]  # the digits' classes, as the image directories have them
SIZE = 32
FORMATS = ("torchscript", "torch-export", "onnx")


class TinyNet(nn.Module):
    """A torchvision-like classifier in miniature: conv, BatchNorm, ReLU, pooling, linear."""

    def __init__(self, classes: int = len(CLASSES), softmax: bool = False):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, classes)
        self.softmax = softmax

    def forward(self, x):
        out = self.fc(self.features(x))
        return out.softmax(dim=1) if self.softmax else out


def tiny_net(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    net = TinyNet(**kwargs)
    for m in net.modules():  # BatchNorm statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def write_script_model(net, out, fmt: str, *, classes=CLASSES, meta: dict | None = None):
    """What a training script writes: the network in `fmt`, classes.txt, maybe kfvision.json."""
    out.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, SIZE, SIZE)
    if fmt == "torchscript":  # no input size inside: kfvision.json says it
        torch.jit.save(torch.jit.script(net), str(out / "model.pt"))
        meta = {"image_size": SIZE, **(meta or {})}
    elif fmt == "torch-export":  # any batch size
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(net, (x.expand(2, -1, -1, -1),),
                                      dynamic_shapes={"x": {0: batch}})
        torch.export.save(program, out / "model.pt2")
    else:  # the exporter's default: batch 1 fixed, which kfvision runs image by image
        torch.onnx.export(net, (x,), str(out / "model.onnx"), dynamo=True, verbose=False)
    (out / "classes.txt").write_text("\n".join(classes) + "\n")
    if meta:
        (out / "kfvision.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def net():
    return tiny_net()


@pytest.fixture(scope="module")
def script_models(net, tmp_path_factory) -> dict:
    """format -> a script's model directory of `net` in it (written once: ONNX takes seconds)."""
    root = tmp_path_factory.mktemp("script_models")
    return {fmt: write_script_model(net, root / fmt, fmt) for fmt in FORMATS}


def eager_outputs(net, data_dir, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """The eager network's outputs on an image directory, preprocessed as score does."""
    ds = ImageDataset(read_image_directory(data_dir), eval_transform("standard", SIZE))
    images = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.inference_mode():
        return net(Normalizer(tuple(mean), tuple(std))(images))


def scored(path) -> tuple[list[dict], torch.Tensor]:
    with open(path, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return rows, torch.tensor([[float(r[f"scored_probability_{c}"]) for c in CLASSES]
                               for r in rows])


@pytest.mark.parametrize("fmt", FORMATS)
def test_score_gives_the_eager_models_probabilities(fmt, net, script_models, micro_digits,
                                                    tmp_path):
    out = tmp_path / "scored.csv"
    assert cli(["score", "--model", str(script_models[fmt]), "--data", str(micro_digits["val"]),
                "--out", str(out), "--quiet", "--batch-size", "4"]) == 0
    rows, probs = scored(out)
    want = eager_outputs(net, micro_digits["val"]).softmax(dim=1)
    assert len(rows) == len(want) == 10
    assert (probs - want).abs().max() < 1e-5  # the CSV keeps 6 significant digits
    assert [r["scored_label"] for r in rows] == [CLASSES[i] for i in want.argmax(1).tolist()]


@pytest.mark.slow  # 5-7 s of CPU: a server in a process
@pytest.mark.parametrize("fmt", ["torch-export", "onnx"])  # each runtime once: a server is slow
def test_served_as_deployed_answers_v1_and_v2_as_score_does(fmt, script_models, micro_digits,
                                                            tmp_path, capsys):
    """`kfvision serve` with the container arguments of the rendered InferenceService, the model
    mounted at /mnt/models replaced by the script's directory."""
    assert cli(["deploy", "render", "--name", "digits", "--model",
                "pvc://kfvision-data/models/script", "--image", "registry.example.com/kfv:1",
                "--cpu", "2"]) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    (container,) = isvc["spec"]["predictor"]["containers"]
    args = container["args"][1:]  # `serve` is the subcommand the client adds
    args[args.index("/mnt/models")] = str(script_models[fmt])
    assert cli(["score", "--model", str(script_models[fmt]), "--data", str(micro_digits["val"]),
                "--out", str(tmp_path / "s.csv"), "--quiet"]) == 0
    rows, probs = scored(tmp_path / "s.csv")
    imdir = read_image_directory(micro_digits["val"])
    files = [(micro_digits["val"] / e.path).read_bytes() for e in imdir.images]
    server = Server(args, tmp_path / "server.log")
    try:
        status, body = request(f"{server.url}/v2/models/digits/infer", v2_body(files))
        assert status == 200, body
        out = {o["name"]: o for o in body["outputs"]}
        assert out["label"]["data"] == [r["scored_label"] for r in rows]
        got = torch.tensor(out["probabilities"]["data"]).view(len(files), len(CLASSES))
        assert (got - probs).abs().max() < 1e-5
        status, body = request(f"{server.url}/v1/models/digits:predict", v1_body(files[:2]))
        assert status == 200 and [p["label"] for p in body["predictions"]] == \
            [r["scored_label"] for r in rows[:2]]
        runtime = "onnx" if fmt == "onnx" else "torch"
        assert f"({runtime}, 10 classes)" in server.log.read_text()
    finally:
        server.stop()


def test_the_predictor_serves_torchscript_as_score_scores_it(script_models, micro_digits,
                                                            tmp_path):
    """What the server runs, in process (the server itself: the test above, other formats)."""
    from kfvision.trainer.use.predict import Predictor

    folder = script_models["torchscript"]
    assert cli(["score", "--model", str(folder), "--data", str(micro_digits["val"]), "--out",
                str(tmp_path / "s.csv"), "--quiet"]) == 0
    _, want = scored(tmp_path / "s.csv")
    predictor = Predictor(folder, threads=1)
    assert predictor.runtime == "torch" and predictor.classes == CLASSES
    imdir = read_image_directory(micro_digits["val"])
    batch = torch.stack([predictor.preprocess((micro_digits["val"] / e.path).read_bytes())
                         for e in imdir.images])
    assert (torch.from_numpy(predictor.probabilities(batch)) - want).abs().max() < 1e-5
    with pytest.raises(InvalidParameterError, match="runtime = 'onnx' cannot run"):
        Predictor(folder, runtime="onnx")


def test_a_network_that_outputs_probabilities_says_so_and_scores_the_same(micro_digits,
                                                                          tmp_path):
    net = tiny_net(softmax=True)
    folder = write_script_model(net, tmp_path / "m", "torchscript",
                                meta={"output": "probabilities", "mean": [0.5] * 3,
                                      "std": [0.25] * 3, "eval_preset": "standard"})
    assert cli(["score", "--model", str(folder), "--data", str(micro_digits["val"]), "--out",
                str(tmp_path / "s.csv"), "--quiet"]) == 0
    _, probs = scored(tmp_path / "s.csv")
    want = eager_outputs(net, micro_digits["val"], [0.5] * 3, [0.25] * 3)  # the network's own
    assert (probs - want).abs().max() < 1e-5  # not their softmax: what "output" is for


def test_export_where_the_file_allows_and_a_named_error_where_not(net, script_models, tmp_path,
                                                                  capsys):
    from kfvision.trainer.use.export import load_exported

    pt2 = str(script_models["torch-export"])
    for fmt, suffix in (("onnx", ".onnx"), ("torchscript", ".pt")):
        out = tmp_path / f"export{suffix}"
        assert cli(["export", "--model", pt2, "--format", fmt, "--out", str(out)]) == 0
        exported, meta = load_exported(out, fmt)
        assert meta["classes"] == CLASSES and meta["image_size"] == SIZE
        images = torch.randint(0, 256, (3, 3, SIZE, SIZE), dtype=torch.uint8)
        with torch.inference_mode():
            want = net(Normalizer(IMAGENET_MEAN, IMAGENET_STD)(images)).softmax(1)
            assert (exported(images) - want).abs().max() < 1e-4
    capsys.readouterr()
    for fmt, to in (("torchscript", "onnx"), ("onnx", "torchscript"), ("onnx", "onnx")):
        assert cli(["export", "--model", str(script_models[fmt]), "--format", to, "--out",
                    str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert "ExportNotSupportedError" in err and "model.pt2" in err
        assert not (tmp_path / "refused").exists()


def test_a_torch_export_model_exports_to_int8(script_models, micro_digits, tmp_path):
    from kfvision.trainer.use.predict import Predictor
    from kfvision.trainer.use.quantize import export_int8

    out = tmp_path / "int8.onnx"
    meta = export_int8(script_models["torch-export"], out, micro_digits["train"],
                       micro_digits["val"], calibration=20, progress=False)
    assert meta["quantization"]["calibration_images"] == 20 and meta["classes"] == CLASSES
    assert Predictor(out).runtime == "openvino"


def test_pushed_to_s3_then_scored_from_there(s3_bucket, script_models, micro_digits, tmp_path):
    uri = s3_bucket.uri("models/script/")
    assert cli(["push", str(script_models["onnx"]), uri]) == 0
    for out in ("dir.csv", "s3.csv"):
        model = str(script_models["onnx"]) if out == "dir.csv" else uri
        assert cli(["score", "--model", model, "--data", str(micro_digits["val"]), "--out",
                    str(tmp_path / out), "--quiet"]) == 0
    assert (tmp_path / "dir.csv").read_text() == (tmp_path / "s3.csv").read_text()


def test_registered_in_mlflow_then_scored_as_models_uri(mlflow_server, script_models,
                                                        micro_digits, tmp_path, monkeypatch,
                                                        capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = script_models["torch-export"]
    assert cli(["register", "--model", str(folder), "--name", "script-digits"]) == 0
    assert "registered: script-digits version 1" in capsys.readouterr().out
    assert cli(["register", "--model", str(folder), "--name", "script-digits"]) == 0
    assert "already registered (same content)" in capsys.readouterr().out
    (version,) = MlflowClient(tracking_uri=mlflow_server).search_model_versions(
        "name='script-digits'")
    assert version.tags["kfvision.model_format"] == "torch-export"
    assert json.loads(version.tags["kfvision.classes"]) == CLASSES
    assert version.tags["kfvision.image_size"] == str(SIZE)
    for out in ("dir.csv", "registered.csv", "cached.csv"):  # the third from the cache
        model = str(folder) if out == "dir.csv" else "models:/script-digits/1"
        assert cli(["score", "--model", model, "--data", str(micro_digits["val"]), "--out",
                    str(tmp_path / out), "--quiet"]) == 0
    texts = {(tmp_path / out).read_text() for out in ("dir.csv", "registered.csv", "cached.csv")}
    assert len(texts) == 1


def test_registered_in_the_kubeflow_registry(fake_registry, script_models, capsys):  # noqa: F811
    argv = ["register", "--model", str(script_models["onnx"]), "--name", "script-digits",
            "--registry", "kubeflow", "--registry-url", fake_registry.url, "--storage-uri",
            "pvc://kfvision-data/models/script-digits", "--author", "ci"]
    assert cli(argv) == 0
    assert "registered: script-digits version sha256-" in capsys.readouterr().out
    (version,) = fake_registry.of("ModelVersion")
    props = version["customProperties"]
    assert props["image_size"]["int_value"] == str(SIZE)
    assert props["model_format"]["string_value"] == "onnx"
    assert json.loads(props["classes"]["string_value"]) == CLASSES


def test_register_marks_a_broken_script_directory_not_servable_and_says_why(
        tmp_path, mlflow_server, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    torch.jit.save(torch.jit.script(tiny_net()), str(tmp_path / "model.pt"))
    assert cli(["register", "--model", str(tmp_path), "--name", "broken"]) == 0
    out = capsys.readouterr().out
    assert "not servable: " in out and "has no classes.txt" in out
    assert "`kfvision serve` and `deploy` refuse this version" in out


# --- what a script got wrong: each a named error that says which file and what to write --------

def _state_dict(folder):
    torch.save(tiny_net().state_dict(), folder / "model.pt")


def _torchscript_as_pt2(folder):
    torch.jit.save(torch.jit.script(tiny_net()), str(folder / "model.pt2"))


def _torchscript(folder, **kwargs):
    torch.jit.save(torch.jit.script(tiny_net(**kwargs)), str(folder / "model.pt"))


BROKEN = [
    # (id, what the script wrote, files to add, error type, words the message has)
    ("no classes file", _torchscript, {}, InvalidModelDirectoryError,
     ["has no classes.txt", 'open(f"{model_dir}/classes.txt", "w")']),
    ("unknown format", lambda f: (f / "model.pth").write_bytes(b"\0"), {"classes.txt": "a\n"},
     InvalidModelDirectoryError,
     ["is not a trained model directory", "nor one a training script wrote",
      "it holds classes.txt, model.pth", "torch.jit.save(",
      "torch.export.save(", "torch.onnx.export("]),
    ("empty folder", lambda f: None, {}, InvalidModelDirectoryError,
     ["it is empty", "model.json and weights.pt"]),
    ("kfvision.json only", lambda f: None, {"kfvision.json": "{}"}, InvalidModelDirectoryError,
     ["it holds kfvision.json", "torch.export.save("]),
    ("a state_dict as model.pt", _state_dict, {"classes.txt": "\n".join(CLASSES)},
     InvalidModelDirectoryError, ["is not TorchScript", "torch.save's pickle", "torch.jit.save("]),
    ("TorchScript named model.pt2", _torchscript_as_pt2, {"classes.txt": "\n".join(CLASSES)},
     InvalidModelDirectoryError, ["is not a torch.export program", "name it model.pt"]),
    ("classes and outputs differ", _torchscript, {"classes.txt": "cat\ndog\nbird\n"},
     InvalidModelDirectoryError, ["returns shape [2, 10]", "lists 3 classes"]),
    ("an empty class line", _torchscript, {"classes.txt": "cat\n\ndog\n"},
     InvalidModelDirectoryError, ["classes.txt has an empty line (line 2)"]),
    ("a class twice", _torchscript, {"classes.txt": "cat\ncat\n"}, InvalidModelDirectoryError,
     ["lists class(es) ['cat'] more than once"]),
    ("two class lists", _torchscript, {"classes.txt": "a\nb\n", "kfvision.json": '{"classes": '
                                       '["b", "a"]}'},
     InvalidModelDirectoryError, ["has two different class lists"]),
    ("an unknown key", _torchscript, {"classes.txt": "a\n", "kfvision.json": '{"size": 32}'},
     InvalidModelDirectoryError, ["unknown key(s) size", "image_size, mean, std"]),
    ("bad mean", _torchscript, {"classes.txt": "a\n", "kfvision.json": '{"mean": [0.5]}'},
     InvalidModelDirectoryError, ["'mean' = [0.5] must be 3 numbers"]),
    ("a missing named model", _torchscript, {"classes.txt": "a\n",
                                             "kfvision.json": '{"model": "net.onnx"}'},
     InvalidModelDirectoryError, ["names 'model' = 'net.onnx', which is not in"]),
    ("an unknown output", _torchscript, {"classes.txt": "a\n", "kfvision.json":
                                         '{"output": "scores"}'},
     InvalidModelDirectoryError,
     ["'output' = 'scores' is not valid; choose one of: logits, probabilities"]),
    ("grey-scale input", lambda f: torch.export.save(torch.export.export(
        nn.Conv2d(1, 2, 3), (torch.randn(1, 1, 8, 8),)), f / "model.pt2"),
     {"classes.txt": "a\nb\n"}, InvalidModelDirectoryError,
     ["takes input of shape [1, 1, 8, 8]; kfvision gives [batch, 3, S, S]"]),
    ("a size out of range", _torchscript, {"classes.txt": "a\n", "kfvision.json":
                                           '{"image_size": 4}'},
     InvalidModelDirectoryError, ["'image_size' = 4 must be a whole number of pixels, 8 to"]),
]


@pytest.mark.parametrize("write, files, error, words", [b[1:] for b in BROKEN],
                         ids=[b[0] for b in BROKEN])
def test_a_wrong_layout_is_a_named_error_saying_what_to_write(write, files, error, words,
                                                              tmp_path):
    write(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(error) as e:
        load_model(tmp_path)
    for w in words:
        assert w in str(e.value)


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path, micro_digits, capsys):
    _torchscript(tmp_path)
    assert cli(["score", "--model", str(tmp_path), "--data", str(micro_digits["val"]), "--out",
                str(tmp_path / "s.csv"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "InvalidModelDirectoryError" in err and "Traceback" not in err
    assert not (tmp_path / "s.csv").exists()


def test_onnx_on_cuda_is_refused_and_a_fixed_size_must_agree(script_models, tmp_path):
    with pytest.raises(DeviceError, match="onnxruntime's CPU provider"):
        load_model(script_models["onnx"], device="cuda")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.onnx").write_bytes((script_models["onnx"] / "model.onnx").read_bytes())
    (folder / "classes.txt").write_text("\n".join(CLASSES))
    with pytest.raises(InvalidModelDirectoryError, match="keeps its weights in a file beside it "
                       "that is not there"):
        load_model(folder)  # torch.onnx.export's model.onnx.data was not copied
    (folder / "model.onnx.data").write_bytes(
        (script_models["onnx"] / "model.onnx.data").read_bytes())
    (folder / "kfvision.json").write_text('{"image_size": 64}')
    with pytest.raises(InvalidModelDirectoryError, match="takes 32 x 32 images but kfvision.json "
                       "says image_size 64"):
        load_model(folder)


def test_kfvision_json_names_the_file_where_a_script_wrote_several(script_models, tmp_path):
    for fmt in ("torch-export", "onnx"):
        for f in script_models[fmt].iterdir():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert load_model(tmp_path)[1]["model_file"] == "model.pt2"  # the precedence
    (tmp_path / "kfvision.json").write_text('{"model": "model.onnx"}')
    assert load_model(tmp_path)[1]["model_file"] == "model.onnx"


def test_commands_that_need_kfvisions_own_directory_say_so(script_models):
    with pytest.raises(InvalidModelDirectoryError, match="holds a model a training script wrote"):
        load_trained_model(script_models["torchscript"])


def test_a_fixed_batch_runs_in_slices_and_is_not_exported(net, tmp_path):
    """torch.export's default: the example's batch size, fixed. Scored in slices of it (the last
    one padded); an export, which takes any batch, is refused."""
    from kfvision.trainer.use.export import export

    folder = tmp_path / "fixed"
    folder.mkdir()
    program = torch.export.export(net, (torch.randn(2, 3, SIZE, SIZE),))
    torch.export.save(program, folder / "model.pt2")
    (folder / "classes.txt").write_text("\n".join(CLASSES))
    model, info = load_model(folder)
    x = torch.randn(5, 3, SIZE, SIZE)
    with torch.inference_mode():
        assert (model(x) - net(x)).abs().max() < 1e-5
    with pytest.raises(ExportNotSupportedError, match=r"takes batches of exactly 2 image\(s\)"):
        export(folder, "torchscript", tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
