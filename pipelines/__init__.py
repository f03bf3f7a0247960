"""kfvision pipelines: everything around the trainer, in wings, one per concern.

The wings form layers, lowest first; a module imports from its own layer or a lower one
(tests/test_architecture.py checks it):

- contract.py: the folders a user's script gets, and their variables (a leaf every layer reads);
- clients/: one client per outside system (the Kubernetes API, object storage, the model
  registries), each mapping that system's failures onto the named errors once;
- jobs/: training as a PyTorchJob or TrainJob: render, run locally, run on a cluster;
  serve/: KServe's model server and the InferenceService;
- script/: a user's own training script, run unchanged as such a job;
- tune/: hyperparameter search (Katib Experiments, Optuna locally);
  flow/: the `image-classification` KFP pipeline and its steps;
- cli/: the `kfvision` command line.
"""
