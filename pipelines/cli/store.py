"""`kfvision push`: an image directory or a model directory up to object storage
(pipelines/clients/storepush.py)."""

from kfvision.pipelines.clients.s3 import S3Options, is_s3
from kfvision.trainer.options import HelpFormatter, add_flags, options_of


def _push(args) -> int:
    from pathlib import Path

    from kfvision.pipelines.clients.storepush import push_image_directory, push_model
    from kfvision.trainer.data.imagedir import MANIFEST
    from kfvision.trainer.errors import InvalidParameterError

    if is_s3(args.dir) or not is_s3(args.uri):
        raise InvalidParameterError(
            f"`kfvision push DIR URI` uploads the local folder DIR to an s3:// URI; got DIR "
            f"{args.dir!r} and URI {args.uri!r}.")
    folder = Path(args.dir)
    if not folder.is_dir():
        raise InvalidParameterError(f"{folder} is not a folder: give an image directory (made "
                                    "by `kfvision convert`) or a model directory.")
    push = push_image_directory if (folder / MANIFEST).is_file() else push_model
    pushed = push(folder, args.uri, max_connections=args.max_connections,
                  progress=False if args.quiet else None, overwrite=args.overwrite)
    print(pushed.summary())
    use = ("train on it as --train/--val" if push is push_image_directory else
           "train from it, or serve, score or deploy it, as --model")
    print(f"{use} {pushed.uri}")
    return 0


def register(sub, help: dict) -> None:
    """Add `kfvision push` (`help`: each command's one line, pipelines/cli/__init__.py's HELP)."""
    p = sub.add_parser("push", help=help["push"], formatter_class=HelpFormatter,
                       description="Upload an image directory (its images, its pack, then its "
                       "manifest as version 1: a referenced directory goes up with its images) or "
                       "a model directory (every file but checkpoints/, spec.json last) to an "
                       "s3:// prefix, where `--train`, `--val` and `--model s3://...` read it. "
                       "The last file's presence means the upload is complete. Resumable: "
                       "objects already there with the same size and ETag are not sent again. "
                       "See docs/data.md.")
    p.add_argument("dir", help="the image directory or model directory")
    p.add_argument("uri", help="s3://BUCKET/PREFIX/ to upload it to")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another directory or other objects under the prefix")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_flags(p, options_of(S3Options))
    p.set_defaults(func=_push)
