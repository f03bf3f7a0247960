"""horovod.torch.elastic is not provided by kfvision's bridge (the named error says what is)."""

from kfvision.pipelines.script.hvd import not_provided

not_provided("horovod.torch.elastic")
