"""`kfvision convert | pack | split`: making and preparing image directories."""

from kfvision.pipelines.clients.s3 import S3Options, is_s3
from kfvision.trainer.options import HelpFormatter, add_flags, options_of


def _convert(args) -> int:
    if not is_s3(args.out):
        return _convert_to(args.out, args)
    # Into object storage: converted into a local staging folder, pushed, then removed. An
    # s3:// OUT never becomes a Path (Path("s3://b/x") is "s3:/b/x").
    import shutil
    import tempfile
    from pathlib import Path

    from kfvision.pipelines.clients.s3 import check_bucket
    from kfvision.pipelines.clients.storepush import push_image_directory

    check_bucket(args.out)  # a wrong URI is said before anything is fetched or converted
    if args.work is not None:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="kfvision-convert-", dir=args.work))
    try:
        _convert_to(staging / "imagedir", args)
        pushed = push_image_directory(staging / "imagedir", args.out,
                                      max_connections=args.max_connections,
                                      progress=False if args.quiet else None,
                                      overwrite=args.overwrite)
    finally:  # a rerun converts again; the push then sends only what the store lacks
        shutil.rmtree(staging, ignore_errors=True)
    print(pushed.summary())
    return 0


def _convert_to(out, args) -> int:
    """`kfvision convert` into the local folder `out`."""
    from kfvision.trainer.data.convert import convert

    progress = False if args.quiet else None
    # an s3:// OUT's images are pushed from where they are: no local copy of them first
    src, labels, in_place, extract_to, origin = (args.src, args.labels,
                                                 args.in_place or is_s3(args.out),
                                                 args.extract_to, None)
    overwrite = args.overwrite and not is_s3(args.out)  # an s3:// OUT's is the push's
    if is_s3(args.src) or is_s3(args.labels):  # fetched once into the data place, kept there
        from kfvision.pipelines.clients.datasource import default_place, fetch_source

        _check_out(out, overwrite)  # before a rerun re-extracts a fetched archive
        place = (args.extract_to if is_s3(args.src) else None) or default_place(out)
        local = fetch_source(args.src, place,
                             labels=args.labels, max_connections=args.max_connections,
                             progress=progress)
        print(local.summary)
        src, labels, origin = local.src, local.labels, local.origin
        if is_s3(args.src):  # referenced where it was fetched: no second copy
            in_place, extract_to = True, local.extract_to
    report = convert(src, out, labels=labels, strict=args.strict,
                     overwrite=overwrite, progress=progress, in_place=in_place,
                     extract_to=extract_to, origin=origin)
    print(report.summary())
    if args.pack:  # the image directory is complete and valid already; the pack is an addition
        from kfvision.trainer.data.pack import write_pack

        print(write_pack(out, progress=progress).summary())
    return 0


def _check_out(out, overwrite: bool) -> None:
    from pathlib import Path

    from kfvision.trainer.errors import InvalidDatasetError

    if Path(out).exists() and not overwrite:
        raise InvalidDatasetError(f"{out} already exists; choose a new path or pass --overwrite.")


def _pack(args) -> int:
    from kfvision.trainer.data.pack import write_pack

    print(write_pack(args.dir, force=args.force, progress=False if args.quiet else None).summary())
    return 0


def _split(args) -> int:
    from kfvision.trainer.data.split import split

    counts = split(args.src, args.train_out, args.val_out, fraction=args.fraction,
                   seed=args.seed, overwrite=args.overwrite, in_place=args.in_place)
    for side, out in (("first", args.train_out), ("second", args.val_out)):
        per_class = ", ".join(f"{c}: {n}" for c, n in counts[side].items())
        print(f"wrote {sum(counts[side].values())} images to {out} ({per_class})")
    return 0


def register(sub, help: dict) -> None:
    """Add convert, pack and split to the `kfvision` subparsers (`help`: each command's one
    line, pipelines/cli/__init__.py's HELP)."""
    c = sub.add_parser("convert", help=help["convert"],
                       description="Copy a folder or archive (.zip, .tar, .tar.gz/.tgz, .tar.bz2) "
                       "with one sub-folder per class (maybe under one wrapping folder), or flat "
                       "images plus --labels CSV, or loose images (an unlabelled directory, for "
                       "scoring) into kfvision's image directory format. Unreadable and non-image "
                       "files are skipped and listed. An s3:// OUT is made locally, then pushed "
                       "as `kfvision push` does. See docs/data.md.")
    c.add_argument("src", help="source folder or archive, or an s3:// prefix or archive")
    c.add_argument("out", help="output image directory (must not exist), or an s3:// prefix")
    c.add_argument("--labels", metavar="CSV", help="CSV of path,label (paths relative to SRC; "
                   "a file on disk or inside SRC, or s3://BUCKET/KEY.csv)")
    c.add_argument("--strict", action="store_true", help="fail on any unreadable file")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument("--work", metavar="DIR", help="where an s3:// OUT is made before it is "
                   "pushed (default: a temporary folder)")
    c.add_argument("--in-place", action="store_true", help="copy nothing: OUT's manifest "
                   "references the images where they are (docs/data.md)")
    c.add_argument("--extract-to", metavar="DIR", help="where an archive (--in-place) or s3:// "
                   "SRC is unpacked and kept (default: OUT.fetched)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--pack", action="store_true", help="then write the pack (`kfvision pack "
                   "OUT`): raw pixels, more disk (docs/data.md)")
    add_flags(c, options_of(S3Options))
    c.set_defaults(func=_convert)

    pk = sub.add_parser(
        "pack", help=help["pack"],
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

    sp = sub.add_parser("split", help=help["split"],
                        formatter_class=HelpFormatter)
    sp.add_argument("src", help="input image directory")
    sp.add_argument("train_out", help="first output (FRACTION of each class)")
    sp.add_argument("val_out", help="second output (the rest)")
    sp.add_argument("--fraction", type=float, default=0.9,
                    help="share of each class in the first output")
    sp.add_argument("--seed", type=int, default=1, help="fixes which images go where")
    sp.add_argument("--overwrite", action="store_true", help="replace outputs that exist")
    sp.add_argument("--in-place", action="store_true", help="write two manifests over the "
                    "input's image files instead of two copies of them")
    sp.set_defaults(func=_split)
