"""A writable HOME and the usual caches in every pod kfvision renders.

Every pod runs with `readOnlyRootFilesystem: true`, so the image's HOME (/home/kfvision,
images/Dockerfile) cannot be written: torch hub's pretrained download (`~/.cache/torch`), Hugging
Face (`~/.cache/huggingface`), matplotlib (`~/.config/matplotlib`), Triton and TorchInductor
(`torch.compile`) and pip would fail in the pod with `Read-only file system`. Each pod therefore
gets an emptyDir at HOME_MOUNT and the variables below pointing into it, as Kubeflow's notebook
images and KServe's model servers settled on for the same failure. A value the user gives
(`--env NAME=VALUE`) wins: the default is then left out.

`job run-local` gives the same variables, under its stand-in folder for the pod's emptyDirs
(pipelines/jobs/volumes.py).
"""

HOME_VOLUME, HOME_MOUNT = "kfvision-home", "/kfvision/home"
# variable -> its folder under HOME_MOUNT ("" = HOME itself). Defaults these replace: XDG Base
# Directory spec (~/.cache, ~/.config); torch.hub._get_torch_home; huggingface_hub constants
# (HF_HOME); matplotlib get_configdir (MPLCONFIGDIR); triton runtime/cache.py (~/.triton/cache);
# torch/_inductor/runtime/cache_dir_utils.py (/tmp/torchinductor_<user>); pip's user cache dir.
CACHE_VARS = {
    "HOME": "",
    "XDG_CACHE_HOME": ".cache",
    "TORCH_HOME": ".cache/torch",
    "HF_HOME": ".cache/huggingface",
    "MPLCONFIGDIR": ".config/matplotlib",
    "TRITON_CACHE_DIR": ".triton/cache",
    "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor",
    "PIP_CACHE_DIR": ".cache/pip",
}


def home_env(given=()) -> list:
    """The pod's `env` entries for HOME and the caches, less the names in `given` (the user's)."""
    given = set(given)
    return [{"name": name, "value": f"{HOME_MOUNT}/{sub}".rstrip("/")}
            for name, sub in CACHE_VARS.items() if name not in given]


def home_volume() -> dict:
    return {"name": HOME_VOLUME, "emptyDir": {}}


def home_mount() -> dict:
    return {"name": HOME_VOLUME, "mountPath": HOME_MOUNT}
