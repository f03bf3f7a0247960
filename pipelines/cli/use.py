"""`kfvision score | evaluate | export`: using a trained model."""

from kfvision.pipelines.clients.models import local_model
from kfvision.pipelines.clients.s3 import S3Options
from kfvision.trainer.options import HelpFormatter, add_flags, options_of

MODEL_HELP = "trained model directory, s3://BUCKET/PREFIX/ or models:/NAME/VERSION (docs/data.md)"


def _image_dirs(*dirs) -> None:
    """Read each given image directory's manifest (no look at each file: the reader later does
    that), so that a wrong path is said before torch is imported too."""
    from kfvision.trainer.data.imagedir import read_image_directory

    for d in dirs:
        if d:
            read_image_directory(d, verify="none")


def _score(args) -> int:
    model = local_model(args.model, args.max_connections)
    _image_dirs(args.data)
    from kfvision.trainer.use.score import score

    result = score(model, args.data, args.out, batch_size=args.batch_size,
                   device=args.device, progress=False if args.quiet else None,
                   dct_scaling=args.dct_scaling == "on")
    acc = "" if result["accuracy"] is None else f"; top-1 accuracy {result['accuracy']:.4f}"
    print(f"scored {result['rows']} images into {args.out}{acc}")
    return 0


def _evaluate(args) -> int:
    from kfvision.trainer.use.evaluate import evaluate

    m = evaluate(args.scored, args.out)
    print(f"evaluated {m['rows']} images: accuracy {m['accuracy']:.4f}, top-{m['top_k']} "
          f"{m['top5_accuracy']:.4f}, macro F1 {m['macro_avg']['f1']:.4f}")
    print(f"wrote metrics.json, report.md and confusion_matrix.png to {args.out}")
    from kfvision.trainer.tracking import (
        log_evaluation,  # mlflow itself only when a server is given
    )

    run = log_evaluation(args.out, m, tracking_uri=args.tracking_uri, run_id=args.run_id,
                         experiment=args.experiment)
    if run:
        print(f"logged the evaluation into MLflow run {run}")
    return 0


def _export_int8(args, model) -> int:
    from kfvision.trainer.use.quantize import export_int8

    meta = export_int8(model, args.out, args.calibrate, args.check,
                       calibration=args.calibration_images, check_limit=args.check_limit)
    q = meta["quantization"]
    print(f"wrote the int8 ONNX export of {args.model} to {args.out} (served by {q['runtime']}),"
          f" calibrated on {q['calibration_images']} images of {args.calibrate}: top-1 "
          f"{q['top1_int8']:.2%} in int8 against {q['top1_fp32']:.2%} in fp32 on "
          f"{q['val_images']} images of {args.check} (both in its metadata)")
    return 0


def _export(args) -> int:
    from kfvision.trainer.errors import ExportError, InvalidParameterError

    if args.quantize == "int8":
        missing = [f for f, v in (("--calibrate", args.calibrate), ("--check", args.check))
                   if not v]
        if args.format != "onnx" or missing:
            raise InvalidParameterError(
                "--quantize int8 needs --format onnx, --calibrate TRAIN and --check VAL (missing: "
                f"{', '.join(missing) or '--format onnx'}): the int8 model is calibrated on "
                "training images and refused if it loses top-1 accuracy on VAL")
    model = local_model(args.model, args.max_connections)
    _image_dirs(args.check, args.calibrate)
    if args.quantize == "int8":
        return _export_int8(args, model)
    from kfvision.trainer.use.export import TOLERANCE, check_export, export

    meta = export(model, args.format, args.out)
    size = meta["image_size"]
    print(f"wrote the {args.format} export of {args.model} to {args.out}: input 'image' uint8 "
          f"[batch, 3, {size}, {size}], output 'probabilities' over {len(meta['classes'])} "
          "classes; classes and preprocessing are in its metadata ('kfvision')")
    if args.check:
        r = check_export(model, args.out, args.format, args.check,
                         limit=args.check_limit or 256)
        print(f"checked against PyTorch on {r['images']} images of {args.check}: top-1 agrees on "
              f"{r['top1_agree']}/{r['images']}, largest probability difference "
              f"{r['max_abs_diff']:.2g}")
        if r["max_abs_diff"] > TOLERANCE:
            raise ExportError(f"{args.out} differs from the PyTorch model by more than "
                              f"{TOLERANCE} on {args.check}; do not serve it.")
    return 0


def register(sub, help: dict) -> None:
    """Add score, evaluate and export to the `kfvision` subparsers (`help`: each command's one
    line, pipelines/cli/__init__.py's HELP)."""
    s = sub.add_parser("score", help=help["score"],
                       formatter_class=HelpFormatter)
    s.add_argument("--model", required=True, help=MODEL_HELP)
    s.add_argument("--data", required=True, help="image directory (labelled or not)")
    s.add_argument("--out", required=True, help="output CSV file")
    s.add_argument("--batch-size", type=int, default=64, help="images per batch")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    s.add_argument("--dct-scaling", choices=("on", "off"), default="on",
                   help="decode JPEGs at 1/2, 1/4 or 1/8 size where the resize still shrinks")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    add_flags(s, options_of(S3Options))
    s.set_defaults(func=_score)

    e = sub.add_parser("evaluate", help=help["evaluate"],
                       formatter_class=HelpFormatter)
    e.add_argument("--scored", required=True, help="CSV written by `kfvision score` (labelled)")
    e.add_argument("--out", required=True,
                   help="folder for metrics.json, report.md and confusion_matrix.png")
    e.add_argument("--tracking-uri", help="MLflow server to log the evaluation into (default: "
                   "MLFLOW_TRACKING_URI; none: not logged)")
    e.add_argument("--run-id", help="MLflow run to log into, e.g. the training run (default: "
                   "MLFLOW_RUN_ID, else a new run)")
    e.add_argument("--experiment", help="experiment of a new run (default: "
                   "MLFLOW_EXPERIMENT_NAME, else kfvision)")
    e.set_defaults(func=_evaluate)

    x = sub.add_parser("export", help=help["export"],
                       formatter_class=HelpFormatter)
    x.add_argument("--model", required=True, help=MODEL_HELP)
    x.add_argument("--format", choices=("onnx", "torchscript", "torch-export"), default="onnx",
                   help="artifact type")
    x.add_argument("--out", required=True, help="output file (.onnx, .pt, .pt2)")
    x.add_argument("--check", metavar="DATA", help="image directory to compare the export with "
                   "PyTorch on (int8: labelled)")
    x.add_argument("--check-limit", type=int, help="images of DATA to compare (default: 256; "
                   "with --quantize int8, all; fewer: a random sample)")
    # kfvision.trainer.use.quantize's QUANTIZE and CALIBRATION_IMAGES, written out: importing it
    # would load torch for every command (tests/trainer/test_export_int8.py checks they agree)
    x.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="int8: quantized ONNX for CPUs (needs --calibrate and --check; "
                   "docs/serving.md)")
    x.add_argument("--calibrate", metavar="TRAIN", help="image directory (the training set) "
                   "whose images calibrate the int8 activation ranges")
    x.add_argument("--calibration-images", type=int, default=300,
                   help="images of TRAIN sampled for calibration (default: 300)")
    add_flags(x, options_of(S3Options))
    x.set_defaults(func=_export)
