"""The `kfvision` command line. Run `kfvision --help`, or `kfvision COMMAND --help`."""

import argparse
import os
import subprocess
import sys

from trainer.errors import KfvisionError

EPILOG = """\
typical run (no cluster needed):
  kfvision convert photos/ data/train            # class folders -> image directory
  kfvision model resnet models/r18 --name resnet18
  kfvision train --model models/r18 --train data/train --val data/val --out models/r18-trained
  kfvision score --model models/r18-trained --data data/val --out scored.csv
  kfvision demo                                  # all of the above on scikit-learn's digits
"""


def _convert(args) -> int:
    from trainer.imagedir import convert_class_folders

    report = convert_class_folders(args.src, args.out, strict=args.strict,
                                   overwrite=args.overwrite,
                                   progress=False if args.quiet else None)
    print(report.summary())
    return 0


def _model(args) -> int:
    from trainer.models import write_untrained_model

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
    # Several processes on this machine: hand over to torchrun, exactly as a PyTorchJob would.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "trainer.train", *rest]
    return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _score(args) -> int:
    from trainer.score import score

    result = score(args.model, args.data, args.out, batch_size=args.batch_size,
                   device=args.device, progress=False if args.quiet else None)
    acc = "" if result["accuracy"] is None else f"; top-1 accuracy {result['accuracy']:.4f}"
    print(f"scored {result['rows']} images into {args.out}{acc}")
    return 0


def _demo(args) -> int:
    from pipelines.demo import run_demo

    return run_demo(args.out, epochs=args.epochs)


def build_parser() -> argparse.ArgumentParser:
    from trainer.models import ARCHITECTURES

    p = argparse.ArgumentParser(
        prog="kfvision", description="Train image classifiers with PyTorch DDP, on this machine "
        "or as Kubeflow PyTorchJobs.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="a folder of class folders -> an image directory",
                       description="Copy a folder with one sub-folder per class (or loose images: "
                       "an unlabelled directory, for scoring) into kfvision's image directory "
                       "format. Unreadable and non-image files are skipped and listed.")
    c.add_argument("src", help="source folder")
    c.add_argument("out", help="output image directory (must not exist)")
    c.add_argument("--strict", action="store_true", help="fail on any unreadable file")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_convert)

    m = sub.add_parser("model", help="write an untrained model directory (resnet, densenet)")
    msub = m.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for family, names in ARCHITECTURES.items():
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

    from trainer.train import get_args_parser

    t = sub.add_parser("train", parents=[get_args_parser(add_help=False)],
                       help="train a model (one process, or N with --nproc-per-node)",
                       description="Train with DDP. Same flags as `python -m trainer.train` "
                       "(the torchrun entrypoint).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--nproc-per-node", type=int, default=1,
                   help="processes on this machine (starts torchrun --standalone when > 1)")
    t.set_defaults(func=_train)

    s = sub.add_parser("score", help="score an image directory with a trained model -> CSV",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", required=True, help="trained model directory")
    s.add_argument("--data", required=True, help="image directory (labelled or not)")
    s.add_argument("--out", required=True, help="output CSV file")
    s.add_argument("--batch-size", type=int, default=64, help="images per batch")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_score)

    d = sub.add_parser("demo", help="the whole flow on scikit-learn's handwritten digits",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--out", default="build/demo", help="working folder (replaced)")
    d.add_argument("--epochs", type=int, default=15, help="training epochs")
    d.set_defaults(func=_demo)

    from pipelines.jobs.commands import register as register_job_commands

    register_job_commands(sub)  # kfvision job render|run-local|submit|logs|delete
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
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, _without_option(argv[1:], "--nproc-per-node"))
        return args.func(args)
    except KfvisionError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code

if __name__ == "__main__":
    sys.exit(main())
