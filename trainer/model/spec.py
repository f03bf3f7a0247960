"""The untrained-model directory's `spec.json`: what `kfvision model` writes and training reads.

Imports neither torch nor torchvision (trainer/model/arch.py builds the model from it), so that
`kfvision train` checks a model directory before it starts anything heavy (trainer/inputs.py).
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kfvision.trainer.errors import InvalidModelDirectoryError
from kfvision.trainer.presets import ARCHITECTURES

SPEC_FILE = "spec.json"
WEIGHTS_FILE = "weights.pt"
SPEC_FORMAT = "kfvision.untrained-model"


@dataclass(frozen=True)
class ModelSpec:
    """What `kfvision model` writes and training reads. `weights` is a file in the model folder."""

    family: str
    arch: str
    pretrained: bool = False
    weights: str | None = None
    zero_init_residual: bool = False  # resnet: start each residual block as the identity
    memory_efficient: bool = False  # densenet: gradient checkpointing (less memory, slower)

    def to_json(self) -> dict:
        return {"format": SPEC_FORMAT, "version": 1, **asdict(self)}


HINT = "Make one with `kfvision model resnet DIR --name resnet18` (or densenet)."


def parse_model_spec(data: bytes, where) -> ModelSpec:
    """The ModelSpec whose `spec.json` holds `data` (its bytes), checked as far as the spec alone
    allows (format, version, architecture); no file is read. `where`: the spec's path or URI,
    for the messages.

    Raises:
        InvalidModelDirectoryError: a malformed spec or an unknown architecture.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc.pop("format") != SPEC_FORMAT or doc.pop("version") != 1:
            raise ValueError("unknown format or version")
        spec = ModelSpec(**doc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidModelDirectoryError(f"{where}, the model directory's spec, is malformed "
                                         f"({e}). " + HINT) from e
    if spec.arch not in ARCHITECTURES.get(spec.family, ()):
        raise InvalidModelDirectoryError(f"{where}: unknown architecture "
                                         f"{spec.family}/{spec.arch}. " + HINT)
    return spec


def read_model_spec(model_dir) -> ModelSpec:
    """Read and validate an untrained model directory (or the spec inside a trained one)."""
    model_dir = Path(model_dir)
    path = model_dir / SPEC_FILE
    if not path.is_file():
        raise InvalidModelDirectoryError(f"{model_dir} is not a model directory (no {SPEC_FILE}). "
                                         + HINT)
    spec = parse_model_spec(path.read_bytes(), path)
    if spec.weights and not (model_dir / spec.weights).is_file():
        raise InvalidModelDirectoryError(f"{path} names weights {spec.weights!r} but "
                                         f"{model_dir / spec.weights} is missing. " + HINT)
    return spec
