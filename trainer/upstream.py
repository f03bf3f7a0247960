"""Names other systems define that the trainer reads: the one place in trainer/ that spells them.

Each comes from the released source at the tag we target (never a proposal), named beside it;
docs/upstream.md lists them with every other platform's. pipelines/ imports them from here (the
local TrainJob runner injects what the controller injects); trainer/ imports nothing of pipelines.
"""

# Kubeflow Trainer v2.3.0 (the same in v2.2.0, where the feature came in):
# pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go, constants envNameStatusURL,
# envNameCACert, envNameToken, configMountPath, caCertFileName, tokenFileName, tokenVolumeName,
# tokenExpirySeconds. The plugin is registered only with the `TrainJobStatus` feature gate
# (pkg/runtime/framework/plugins/registry.go; pkg/features/features.go: alpha, default off) and
# injects into every container of the pod set labelled with the trainer ancestor below.
# No release ever injected the KUBEFLOW_TRAINER_STATUS_* names of the KEP-2779 draft.
TRAINER_SERVER_URL = "KUBEFLOW_TRAINER_SERVER_URL"  # the full https URL of this job's status
TRAINER_SERVER_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"  # path of the endpoint's CA file
TRAINER_SERVER_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"  # path of a token that rotates (re-read)
TRAINER_SECRETS_DIR = "/var/run/secrets/kubeflow/trainer"
TRAINER_CA_CERT_FILE = "ca.crt"
TRAINER_TOKEN_FILE = "token"
TRAINER_TOKEN_VOLUME = "kubeflow-trainer-token"
TRAINER_TOKEN_EXPIRY_S = 3600

# Kubeflow Trainer v2.3.0, pkg/statusserver/utils.go (StatusUrl, TokenAudience): the path the
# status server routes (POST only) and the audience of the projected token.
TRAINER_STATUS_PATH = ("/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/"
                       "{name}/status")
TRAINER_TOKEN_AUDIENCE = ("trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}"
                          "/status")

# Kubernetes: the kubelet sets it in every container of a pod (only used to tell "in a pod").
KUBERNETES_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
