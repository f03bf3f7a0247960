"""What a training reads, checked before anything heavy: the model directory's spec and the two
labelled image directories, of the same classes, two or more.

Imports neither torch nor torchvision: `kfvision train` says a wrong path or an unlabelled
directory at once (0.1 s), before it imports torch or starts torchrun's processes, each of which
would import it only to fail the same way. The trainer reads its inputs through the same function.
"""

from typing import NamedTuple

from kfvision.trainer.data.imagedir import ImageDirectory, check_same_classes, read_image_directory
from kfvision.trainer.errors import InvalidDatasetError
from kfvision.trainer.model.spec import ModelSpec, read_model_spec


class Inputs(NamedTuple):
    spec: ModelSpec
    train: ImageDirectory
    val: ImageDirectory


def read_inputs(model, train, val, *, verify: str = "size") -> Inputs:
    """The model directory's spec and the training and validation image directories, checked
    (`verify`: as read_image_directory takes it; "none" reads the manifests alone, without a
    look at each image file, for a check before the trainer's own).

    Raises:
        InvalidModelDirectoryError: `model` is not an untrained model directory.
        InvalidDatasetError (or a subclass): an image directory is missing, unlabelled, of other
            classes than the other, or of a single class.
    """
    spec = read_model_spec(model)
    train_dir = read_image_directory(train, verify=verify).require_labelled("training")
    val_dir = read_image_directory(val, verify=verify).require_labelled("validation")
    check_same_classes(train_dir, val_dir)
    if len(train_dir.classes) < 2:
        raise InvalidDatasetError(f"{train} has a single class; a classifier needs two or more. "
                                  "Add a class folder and convert again.")
    return Inputs(spec, train_dir, val_dir)
