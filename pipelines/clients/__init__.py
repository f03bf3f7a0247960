"""The clients of outside systems, one module per system: endpoint failures as one line
(endpoints), the Kubernetes API (k8s; cluster: the verbs and flags every cluster client and
command shares), object storage (s3, with s3sync and datasource over it), the model registries
(registry), and what `--model` accepts made local (models). Each maps its system's failures onto
the named errors once."""
