"""What each step of the `image-classification` pipeline does, as ordinary functions, one module
per step: check, data, model, train, use (score, evaluate), register, deploy.

The KFP components in `pipelines/flow/components.py` are thin shells over these: each component
imports one function from here, calls it with its inputs' local paths and parameters, and logs
what it returns. So everything here runs (and is tested) without KFP. Which option each
parameter is, and its name (those of the Azure ML designer modules kfvision stands in for), is
in pipelines/flow/params.py.
"""
