"""The `kfvision` command line. Run `kfvision --help`, or `kfvision COMMAND --help`."""

import argparse
import os
import subprocess
import sys

from trainer.errors import KfvisionError
from trainer.presets import ARCHITECTURES

EPILOG = """\
typical run (no cluster needed):
  kfvision convert photos.tar.gz data/all        # class folders (folder or archive)
  kfvision split data/all data/train data/val    # 90/10 per class
  kfvision model resnet models/r18 --name resnet18
  kfvision train --model models/r18 --train data/train --val data/val --out models/r18-trained
  kfvision score --model models/r18-trained --data data/val --out scored.csv
  kfvision evaluate --scored scored.csv --out eval/
  kfvision export --model models/r18-trained --format onnx --out r18.onnx --check data/val
  kfvision demo                                  # all of the above on scikit-learn's digits
"""


def _convert(args) -> int:
    from trainer.data.convert import convert

    progress = False if args.quiet else None
    report = convert(args.src, args.out, labels=args.labels, strict=args.strict,
                     overwrite=args.overwrite, progress=progress)
    print(report.summary())
    if args.pack:  # the image directory is complete and valid already; the pack is an addition
        from trainer.data.pack import write_pack

        print(write_pack(args.out, progress=progress).summary())
    return 0


def _pack(args) -> int:
    from trainer.data.pack import write_pack

    print(write_pack(args.dir, force=args.force, progress=False if args.quiet else None).summary())
    return 0


def _split(args) -> int:
    from trainer.data.split import split

    counts = split(args.src, args.train_out, args.val_out, fraction=args.fraction,
                   seed=args.seed, overwrite=args.overwrite)
    for side, out in (("first", args.train_out), ("second", args.val_out)):
        per_class = ", ".join(f"{c}: {n}" for c, n in counts[side].items())
        print(f"wrote {sum(counts[side].values())} images to {out} ({per_class})")
    return 0


def _evaluate(args) -> int:
    from trainer.use.evaluate import evaluate

    m = evaluate(args.scored, args.out)
    print(f"evaluated {m['rows']} images: accuracy {m['accuracy']:.4f}, top-{m['top_k']} "
          f"{m['top5_accuracy']:.4f}, macro F1 {m['macro_avg']['f1']:.4f}")
    print(f"wrote metrics.json, report.md and confusion_matrix.png to {args.out}")
    return 0


def _export(args) -> int:
    from trainer.errors import ExportError
    from trainer.use.export import TOLERANCE, check_export, export

    meta = export(args.model, args.format, args.out)
    size = meta["image_size"]
    print(f"wrote the {args.format} export of {args.model} to {args.out}: input 'image' uint8 "
          f"[batch, 3, {size}, {size}], output 'probabilities' over {len(meta['classes'])} "
          "classes; classes and preprocessing are in its metadata ('kfvision')")
    if args.check:
        r = check_export(args.model, args.out, args.format, args.check, limit=args.check_limit)
        print(f"checked against PyTorch on {r['images']} images of {args.check}: top-1 agrees on "
              f"{r['top1_agree']}/{r['images']}, largest probability difference "
              f"{r['max_abs_diff']:.2g}")
        if r["max_abs_diff"] > TOLERANCE:
            raise ExportError(f"{args.out} differs from the PyTorch model by more than "
                              f"{TOLERANCE} on {args.check}; do not serve it.")
    return 0


def _model(args) -> int:
    from trainer.model.arch import write_untrained_model

    spec = write_untrained_model(
        args.out, args.name, pretrained=args.pretrained, weights=args.weights,
        zero_init_residual=getattr(args, "zero_init_residual", False),
        memory_efficient=getattr(args, "memory_efficient", False))
    source = ("ImageNet weights" if spec.pretrained else
              f"weights from {args.weights}" if args.weights else "random initialisation")
    print(f"wrote untrained {spec.arch} ({source}) to {args.out}")
    return 0


def _train(args, rest) -> int:
    from trainer import train

    nproc = args.nproc_per_node
    if nproc == 1:
        return train.main(rest)
    # Several processes on this machine: hand over to torchrun, exactly as a PyTorchJob would
    # (through trainer.launch, which keeps the training processes' exit codes).
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "trainer.train", *rest]
    return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _score(args) -> int:
    from trainer.use.score import score

    result = score(args.model, args.data, args.out, batch_size=args.batch_size,
                   device=args.device, progress=False if args.quiet else None,
                   dct_scaling=args.dct_scaling == "on")
    acc = "" if result["accuracy"] is None else f"; top-1 accuracy {result['accuracy']:.4f}"
    print(f"scored {result['rows']} images into {args.out}{acc}")
    return 0


def _demo(args) -> int:
    from pipelines.demo import run_demo

    return run_demo(args.out, epochs=args.epochs)


# The one-line help of the commands whose flags come from modules that import torch or kfp.
HELP = {
    "train": "train a model (one process, or N with --nproc-per-node)",
    "job": "train as a Kubeflow PyTorchJob: render, run-local, submit, logs, delete",
    "pipeline": "the Kubeflow Pipelines pipeline: compile, submit, run-local",
}


def build_parser(argv: list | None = None) -> argparse.ArgumentParser:
    """The `kfvision` parser. With `argv`, the flags of only the command it names are built: the
    train, job and pipeline flags import torch or kfp (`kfvision --help` took 8 s with all of
    them), and no other command should wait for that."""
    command = argv[0] if argv else None

    def full(name: str) -> bool:
        return argv is None or command == name

    p = argparse.ArgumentParser(
        prog="kfvision", description="Train image classifiers with PyTorch DDP, on this machine "
        "or as Kubeflow PyTorchJobs.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="a folder or archive of images -> an image directory",
                       description="Copy a folder or archive (.zip, .tar, .tar.gz/.tgz, .tar.bz2) "
                       "with one sub-folder per class (maybe under one wrapping folder), or flat "
                       "images plus --labels CSV, or loose images (an unlabelled directory, for "
                       "scoring) into kfvision's image directory format. Unreadable and non-image "
                       "files are skipped and listed. See docs/data.md.")
    c.add_argument("src", help="source folder or archive")
    c.add_argument("out", help="output image directory (must not exist)")
    c.add_argument("--labels", metavar="CSV", help="CSV of path,label (paths relative to SRC; "
                   "a file on disk or inside SRC)")
    c.add_argument("--strict", action="store_true", help="fail on any unreadable file")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--pack", action="store_true", help="then write the pack (`kfvision pack "
                   "OUT`): raw pixels for fast training on data too big to cache in memory; "
                   "costs width x height x 3 bytes of disk per image, 5-8x the JPEG files")
    c.set_defaults(func=_convert)

    pk = sub.add_parser(
        "pack", help="add raw pixels to an image directory: fast training without decoding",
        description="Decode every image of an image directory once and store the raw RGB pixels "
        "beside it (kfvision-pack.rgb, indexed by kfvision-pack.json). Training then reads "
        "pixels instead of decoding JPEGs every epoch: for data too big to cache in memory. "
        "DISK COST: width x height x 3 bytes per image, 5-8x the size of quality-90 JPEGs "
        "(a 500x375 image is 560 KB). A pack that no longer matches the directory is ignored with "
        "a warning; run this again to rebuild it. Delete the two files to remove it. See "
        "docs/data.md.")
    pk.add_argument("dir", help="image directory (made by `kfvision convert`)")
    pk.add_argument("--force", action="store_true", help="rewrite a pack that is up to date")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(func=_pack)

    m = sub.add_parser("model", help="write an untrained model directory (resnet, densenet)")
    msub = m.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for family, names in ARCHITECTURES.items():  # torch-free names: cheap for every command
        f = msub.add_parser(family, help=f"{family}: {', '.join(names)}",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        f.add_argument("out", help="output model directory")
        f.add_argument("--name", default=names[0], choices=names, help="architecture")
        w = f.add_mutually_exclusive_group()
        w.add_argument("--pretrained", action="store_true",
                       help="start from torchvision's ImageNet weights (needs network or a warm "
                       "torch hub cache; stored in the model directory)")
        w.add_argument("--weights", metavar="FILE", help="start from a local state_dict file")
        if family == "resnet":
            f.add_argument("--zero-init-residual", action="store_true",
                           help="zero-init the last BN of each residual block")
        else:
            f.add_argument("--memory-efficient", action="store_true",
                           help="gradient checkpointing: less memory, ~20%% slower")
        f.set_defaults(func=_model)

    if full("train"):
        from trainer.config import get_args_parser

        t = sub.add_parser("train", parents=[get_args_parser(add_help=False)],
                           help=HELP["train"],
                           description="Train with DDP. Same flags as `python -m trainer.train` "
                           "(the torchrun entrypoint).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        t.add_argument("--nproc-per-node", type=int, default=1,
                       help="processes on this machine (starts torchrun --standalone when > 1)")
        t.set_defaults(func=_train)
    else:
        sub.add_parser("train", help=HELP["train"])

    s = sub.add_parser("score", help="score an image directory with a trained model -> CSV",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", required=True, help="trained model directory")
    s.add_argument("--data", required=True, help="image directory (labelled or not)")
    s.add_argument("--out", required=True, help="output CSV file")
    s.add_argument("--batch-size", type=int, default=64, help="images per batch")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    s.add_argument("--dct-scaling", choices=("on", "off"), default="on",
                   help="decode a JPEG at 1/2, 1/4 or 1/8 of its size (libjpeg DCT scaling) when "
                   "the model's resize still shrinks it from there, as validation in training "
                   "does: camera photos decode about twice as fast")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_score)

    sp = sub.add_parser("split", help="split an image directory in two, stratified by class",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("src", help="input image directory")
    sp.add_argument("train_out", help="first output (FRACTION of each class)")
    sp.add_argument("val_out", help="second output (the rest)")
    sp.add_argument("--fraction", type=float, default=0.9,
                    help="share of each class in the first output")
    sp.add_argument("--seed", type=int, default=1, help="fixes which images go where")
    sp.add_argument("--overwrite", action="store_true", help="replace outputs that exist")
    sp.set_defaults(func=_split)

    e = sub.add_parser("evaluate", help="metrics, report and confusion matrix of a scored CSV",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--scored", required=True, help="CSV written by `kfvision score` (labelled)")
    e.add_argument("--out", required=True,
                   help="folder for metrics.json, report.md and confusion_matrix.png")
    e.set_defaults(func=_evaluate)

    x = sub.add_parser("export", help="export a trained model: ONNX, TorchScript, torch.export",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    x.add_argument("--model", required=True, help="trained model directory")
    x.add_argument("--format", choices=("onnx", "torchscript", "torch-export"), default="onnx",
                   help="artifact type")
    x.add_argument("--out", required=True, help="output file (.onnx, .pt, .pt2)")
    x.add_argument("--check", metavar="DATA", help="image directory to compare the export with "
                   "PyTorch on")
    x.add_argument("--check-limit", type=int, default=256, help="images of DATA to compare")
    x.set_defaults(func=_export)

    d = sub.add_parser("demo", help="the whole KFP pipeline, run locally, on scikit-learn's digits",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--out", default="build/demo", help="working folder (replaced)")
    d.add_argument("--epochs", type=int, default=15, help="training epochs")
    d.set_defaults(func=_demo)

    if full("job"):
        from pipelines.jobs.commands import register as register_job_commands

        register_job_commands(sub, HELP["job"])  # kfvision job render|run-local|submit|...
    else:
        sub.add_parser("job", help=HELP["job"])
    if full("pipeline"):
        from pipelines.commands_pipeline import register as register_pipeline_commands

        register_pipeline_commands(sub, HELP["pipeline"])  # kfvision pipeline compile|...
    else:
        sub.add_parser("pipeline", help=HELP["pipeline"])
    return p


def _without_option(argv: list, flag: str) -> list:
    """argv less `flag VALUE` / `flag=VALUE` (what kfvision adds on top of the trainer's flags)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, _without_option(argv[1:], "--nproc-per-node"))
        return args.func(args)
    except KfvisionError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code

if __name__ == "__main__":
    sys.exit(main())
