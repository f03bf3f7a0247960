# Sourced from the repository root by bench/gpu.sh and bench/device_run.sh: makes
# `import kfvision.trainer` find this checkout's trainer/ (and kfvision.pipelines its pipelines/)
# where kfvision is not installed, as on a lent GPU machine (torch and torchvision there, no
# network). setup.py maps the two folders under the name kfvision; without an install the same
# mapping is two symbolic links in build/importroot/kfvision/ (a namespace package: no
# __init__.py), put first on PYTHONPATH, for this shell and the processes it starts.
#
# An install that is this checkout (`pip install -e .`) is used as it is; one of another checkout
# or version is passed over for this one.
_kfv_python="${PYTHON:-python3}"
_kfv_found="$("$_kfv_python" -c 'import os, kfvision.trainer as t; print(os.path.realpath(t.__path__[0]))' 2>/dev/null || true)"
if [ "$_kfv_found" != "$(realpath trainer)" ]; then
    mkdir -p build/importroot/kfvision
    ln -sfn ../../../trainer build/importroot/kfvision/trainer
    ln -sfn ../../../pipelines build/importroot/kfvision/pipelines
    export PYTHONPATH="$PWD/build/importroot${PYTHONPATH:+:$PYTHONPATH}"
    echo "kfvision: not installed from this checkout${_kfv_found:+ (found $_kfv_found)};" \
        "importing it from $PWD/build/importroot" >&2
fi
unset _kfv_python _kfv_found
