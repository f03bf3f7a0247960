"""Train an image classifier; the torchrun entrypoint of kfvision.

One process:       python -m kfvision.trainer.train --model M --train T --val V --out O
N processes:       torchrun --nproc-per-node N -m kfvision.trainer.train --model M ...
Kubeflow PyTorchJob: the same torchrun command; torchrun reads the operator's PET_* variables.
`kfvision train ...` takes the same flags.
"""

import json
import logging
import sys
from pathlib import Path

import torch

from kfvision.trainer import distributed, exitcodes
from kfvision.trainer.checkpoint import (
    FOLDER,
    KEEP,
    MUST_MATCH,
    Checkpointer,
    check_writable,
    output_error,
)
from kfvision.trainer.config import TrainConfig, config_from_args, get_args_parser
from kfvision.trainer.data.datasets import EvalShard, ImageDataset, cache_bytes, make_loader
from kfvision.trainer.data.decode import JPEG_SUFFIXES
from kfvision.trainer.data.devicedata import EncodedImages, make_device_loader
from kfvision.trainer.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Normalizer,
    eval_transform,
    train_transform,
)
from kfvision.trainer.engine import Trainer
from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.fastpath import describe, resolve_fast_path
from kfvision.trainer.fileio import atomic_write_json
from kfvision.trainer.inputs import read_inputs
from kfvision.trainer.model.arch import build_model, check_image_size, head_keys
from kfvision.trainer.model.spec import WEIGHTS_FILE
from kfvision.trainer.model.trained import atomic_torch_save, write_model_files
from kfvision.trainer.recipes import data_preset
from kfvision.trainer.reporting import EpochReporter
from kfvision.trainer.rng import seed_everything
from kfvision.trainer.tracking import RUN_ID_KEY, Tracker
from kfvision.trainer.trainjob_status import StatusReporter

log = logging.getLogger("trainer")


def _suggest_pack(cfg: TrainConfig, train_dir, cached: int) -> None:
    """Say how to stop decoding every epoch, when that is what training will do. `cached`: the
    bytes a cache of the training images would have taken."""
    gib = train_dir.decoded_bytes() / 2**30
    why = ("--cache off" if cfg.cache == "off" else
           f"{cached / 2**30:.1f} GiB decoded, more than a quarter of the free memory")
    log.info("the training images are decoded again every epoch (%s). `kfvision pack %s` "
             "stores them once as raw pixels (%.1f GiB of disk) and makes the epochs several "
             "times faster on the CPU (docs/data.md)", why, cfg.train, gib)


def run(cfg: TrainConfig, ctx: distributed.DistContext) -> dict:
    """Read inputs, train, and (rank 0) write the trained model directory. Returns the summary."""
    cfg = cfg.resolved()  # the recipe's values where no option was given
    spec, train_dir, val_dir = read_inputs(cfg.model, cfg.train, cfg.val)
    check_image_size(spec, cfg.image_size)
    jpegs = sum(e.path.lower().endswith(JPEG_SUFFIXES) for e in train_dir.images)
    preset = data_preset(cfg.augment)
    train_tf = train_transform(preset, cfg.image_size)
    cached = cache_bytes(train_dir, train_tf, cfg.dct_scaling == "on")
    rt = resolve_fast_path(cfg, ctx, cached + val_dir.decoded_bytes(),
                           jpegs / len(train_dir.images),
                           arriving=train_dir.arrival is not None or val_dir.arrival is not None,
                           family=spec.family)
    if ctx.device.type == "cpu":
        torch.set_num_threads(distributed.cpus_per_process(ctx))
    else:  # cuDNN's heuristics, not its timed search: the search cost seconds of the first
        # steps (every shape planned at run time) for no faster step (docs/benchmarks.md, "GPU")
        torch.backends.cudnn.benchmark = False
    seed_everything(cfg.seed)
    model = build_model(spec, len(train_dir.classes), cfg.model, image_size=cfg.image_size)
    # decoding up front (the cache, the evaluation crops) uses this process's cores; a bar on
    # a terminal, from one process
    decoding = {"threads": distributed.cpus_per_process(ctx),
                "progress": None if ctx.is_main else False}
    val_ds = ImageDataset(val_dir, eval_transform(preset, cfg.image_size),
                          precompute=rt.cache, dct_scaling=cfg.dct_scaling == "on", **decoding)
    pin = ctx.device.type == "cuda"
    options = {"batch_size": cfg.batch_size, "workers": rt.workers, "shuffle": True,
               "seed": cfg.seed, "rank": ctx.rank, "world_size": ctx.world_size, "pin_memory": pin}
    if rt.gpu_decode:  # workers only read files; batches are decoded + augmented on the device
        train_ds = EncodedImages(train_dir)
        train_loader, sampler = make_device_loader(train_ds, augment=preset,
                                                   image_size=cfg.image_size, device=ctx.device,
                                                   **options)
    else:
        train_ds = ImageDataset(train_dir, train_tf, cache=rt.cache, dct_scaling=rt.dct_scaling,
                                **decoding)
        train_loader, sampler = make_loader(train_ds, **options)
    if ctx.is_main and not rt.cache and not rt.gpu_decode and train_ds.pack is None:
        _suggest_pack(cfg, train_dir, cached)
    val_loader, _ = make_loader(EvalShard(val_ds, ctx.rank, ctx.world_size),
                                batch_size=2 * cfg.batch_size, workers=min(rt.workers, 2),
                                shuffle=False, seed=cfg.seed, pin_memory=pin)
    out = Path(cfg.out)
    checkpointer = _checkpointer(cfg, ctx, out, spec.arch, train_dir.classes, model)
    info = {"arch": spec.arch, "classes": list(train_dir.classes), "image_size": cfg.image_size,
            "eval_preset": preset, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_model_files(out, spec, info, {**cfg.to_dict(), "world_size": ctx.world_size,
                                            "fast_path": rt.to_dict()})
        log.info("training %s on %d images (%d classes), validating on %d; %d process(es) on %s, "
                 "batch %d/process, lr %g x %d; %s", spec.arch, len(train_ds),
                 len(train_dir.classes), len(val_ds), ctx.world_size, ctx.device.type,
                 cfg.batch_size, cfg.lr, ctx.world_size, describe(rt))
    trainer = Trainer(cfg, ctx, model, train_loader, val_loader, sampler,
                      Normalizer(IMAGENET_MEAN, IMAGENET_STD), rt,
                      num_classes=len(train_dir.classes), head=head_keys(spec.arch))

    status = StatusReporter.from_env(cfg.epochs) if ctx.is_main else None  # TrainJob progress
    report = EpochReporter(cfg.tensorboard or None)
    tracker = _tracker(cfg, ctx, rt, checkpointer)

    def on_epoch(history, best_state):  # rank 0 only: keep what we have if a later epoch fails
        try:
            report(history)
            if tracker is not None:
                tracker.log_epochs(history)
            if best_state is not None:
                atomic_torch_save(best_state, out / WEIGHTS_FILE)
            atomic_write_json(out / "metrics.json", {"status": "running", "history": history,
                                                     "fast_path": rt.to_dict()})
        except OSError as e:
            raise output_error(e, out) from e
        if status is not None:
            status.epoch_done(history)

    try:
        summary = trainer.fit(on_epoch, checkpointer)
    except BaseException as e:
        if ctx.is_main:
            _mark_failed(out, e)
        if tracker is not None:
            tracker.finish(ok=False)
        raise
    finally:
        report.close()
    summary.pop("best_state")

    def completed():
        try:
            atomic_write_json(out / "metrics.json", {"status": "completed", **summary,
                                                     "fast_path": rt.to_dict()})
        except OSError as e:
            raise output_error(e, out) from e

    distributed.on_main(ctx, completed)
    checkpointer.finish()  # the model directory is the result now
    if tracker is not None:
        tracker.log_epochs(summary["history"])
        tracker.log_model(out)
        tracker.finish(ok=True)
    if ctx.is_main:
        f = summary["final"]
        log.info("done: best epoch %d of %d, val top1 %.4f top5 %.4f loss %.4f, %.1f train img/s; "
                 "model in %s", summary["best_epoch"], summary["epochs_run"], f["val_top1"],
                 f["val_top5"], f["val_loss"], f["train_images_per_sec"], out)
    return summary


def _checkpointer(cfg: TrainConfig, ctx, out: Path, arch: str, classes, model) -> Checkpointer:
    """Fail fast (every rank) when `out` cannot take the run's files; then a Checkpointer."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # at worst KEEP + 1 checkpoints of model + momentum, one more being written, weights.pt twice
    distributed.on_main(ctx, lambda: check_writable(out, (2 * (KEEP + 2) + 2) * model_bytes))
    settings = {**{k: getattr(cfg, k) for k in MUST_MATCH}, "world_size": ctx.world_size,
                "arch": arch, "classes": list(classes)}
    return Checkpointer(Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out / FOLDER, ctx,
                        settings)


def _tracker(cfg: TrainConfig, ctx, rt, checkpointer: Checkpointer) -> Tracker | None:
    """Rank 0's MLflow run (None when tracking is off or on other ranks), its id kept in every
    checkpoint so that a resumed run continues it."""
    tracker = Tracker.from_env(cfg) if ctx.is_main else None
    if tracker is None:
        return None
    tracker.tags.update({"kfvision.world_size": ctx.world_size,
                         "kfvision.device": ctx.device.type,
                         "kfvision.precision": "bf16" if rt.amp else "fp32"})
    params = {**{k: v for k, v in cfg.to_dict().items() if k != "tracking_uri"},
              "world_size": ctx.world_size}
    run_id = tracker.start(params, checkpointer.saved(RUN_ID_KEY))
    if run_id:
        checkpointer.extra[RUN_ID_KEY] = run_id
    return tracker


def _mark_failed(out: Path, e: BaseException) -> None:
    """metrics.json says the run failed and why (best effort: the disk may be what failed)."""
    path = out / "metrics.json"
    try:
        if path.exists():
            doc = json.loads(path.read_text())
            atomic_write_json(path, {**doc, "status": "failed", "error": str(e)})
    except (OSError, ValueError) as write_error:
        log.warning("could not mark %s as failed: %s", path, write_error)


def _message(e: BaseException, code: int) -> str:
    if isinstance(e, KfvisionError):
        return f"{type(e).__name__}: {e}"
    first = str(e).splitlines()[0] if str(e) else ""
    return (f"{type(e).__name__}: {first} -- exiting with {code} ({exitcodes.describe(code)}); "
            "a restarted job resumes from the last checkpoint.")


class _Stdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a line is logged, not to the one there when the
    handler was made: a caller that runs `main` in its own process and then replaces or closes
    its stdout (the tests' capture, a notebook cell) gets no "I/O operation on closed file"."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass


# Whose lines a kfvision command shows: the trainer's, and kfvision's own (kfvision.tune, ...)
SHOWN_LOGGERS = ("trainer", "kfvision")


def setup_logging(is_main: bool) -> None:
    """Show SHOWN_LOGGERS' lines on stdout with the time: INFO and up on the main process,
    warnings only on the others. The root logger is left as it is: a caller that runs `main` in
    its own process (a notebook, `kfvision tune run`, the tests) keeps its handlers, and other
    libraries' INFO lines (botocore's "Found credentials ...") stay hidden. Our lines still
    reach the root's handlers too (a host that logs to a file gets them there)."""
    for name in SHOWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO if is_main else logging.WARNING)
        if not any(isinstance(h, _Stdout) for h in logger.handlers):
            handler = _Stdout()
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
    ctx = None
    try:
        cfg = config_from_args(args)
        ctx = distributed.init(cfg.device)
        setup_logging(ctx.is_main)
        run(cfg, ctx)
    except BaseException as e:
        code = exitcodes.for_exception(e)  # see trainer/exitcodes.py for the whole table
        if code is None:
            raise  # unexpected: a bug; the traceback and exit code 1 (permanent) say so
        print(f"error: {_message(e, code)}", file=sys.stderr)
        return code
    finally:
        distributed.cleanup()
    return 0


if __name__ == "__main__":
    from kfvision.trainer.heap import freeze_imports

    freeze_imports()
    sys.exit(main())
