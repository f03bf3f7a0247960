"""The model steps: the untrained model directory, and the trained one pushed to object storage."""





def model_step(out, model_name: str, pretrained: bool, zero_init_residual: bool = False,
               memory_efficient: bool = False) -> dict:
    """Write an untrained model directory; returns its spec as a dict."""
    from kfvision.trainer.model.arch import write_untrained_model

    spec = write_untrained_model(out, model_name, pretrained=pretrained,
                                 zero_init_residual=zero_init_residual,
                                 memory_efficient=memory_efficient)
    return {"arch": spec.arch, "family": spec.family, "pretrained": spec.pretrained}


def push_model_step(model_dir, model_uri: str) -> dict:
    """Upload the trained model directory to `model_uri` (s3://, replacing what is there; its
    checkpoints stay behind), for KServe and `--model s3://...`; returns {"model_uri", "files"}."""
    from pathlib import Path

    from kfvision.pipelines.clients.s3sync import push
    from kfvision.trainer.model.scripted import has_script_model, read_script_model

    last = "model.json"
    if not (Path(model_dir) / last).is_file() and has_script_model(model_dir):  # a script's
        last = read_script_model(model_dir).path.name  # its network last: no network, no model
    keys = push(model_dir, model_uri, skip=("checkpoints",), last=last, overwrite=True)
    print(f"pushed {len(keys)} file(s) of the trained model to {model_uri}", flush=True)
    return {"model_uri": model_uri, "files": len(keys)}
