"""The `image-classification` KFP pipeline: its parameters, components and steps, its local
run (KFP's local runner), the demo and the run's report."""
