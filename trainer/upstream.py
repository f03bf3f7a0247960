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

# MLflow: the variables Kubeflow Pipelines 2.17.0 injects into a task's container where MLflow is
# configured with `injectUserEnvVars` (kubeflow/pipelines 2.17.0,
# backend/src/v2/common/plugins/mlflow/handler.go RetrieveUserContainerEnvVars;
# backend/src/common/plugins/mlflow/config.go), read by the MLflow client itself as defined in
# mlflow v3.17.2, mlflow/environment_variables.py. The train step forwards them into the job's
# pods; the trainer reads the first four (the client reads the credentials on its own).
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"  # KFP: the task's nested run
MLFLOW_EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
MLFLOW_EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"  # not injected by KFP; the client honours it
MLFLOW_WORKSPACE = "MLFLOW_WORKSPACE"  # KFP: only with workspaces on (MLflow >= 3.10)
MLFLOW_TRACKING_AUTH = "MLFLOW_TRACKING_AUTH"  # KFP: `kubernetes` or `kubernetes-namespaced`
MLFLOW_TRACKING_TOKEN = "MLFLOW_TRACKING_TOKEN"  # KFP: bearer credentials from a Secret
MLFLOW_TRACKING_USERNAME = "MLFLOW_TRACKING_USERNAME"  # KFP: basic credentials from a Secret
MLFLOW_TRACKING_PASSWORD = "MLFLOW_TRACKING_PASSWORD"
# mlflow v3.17.2, mlflow/environment_variables.py: TLS settings a user may give (not KFP's)
MLFLOW_TRACKING_INSECURE_TLS = "MLFLOW_TRACKING_INSECURE_TLS"
MLFLOW_TRACKING_SERVER_CERT_PATH = "MLFLOW_TRACKING_SERVER_CERT_PATH"
# what the train step forwards into the job's pods when it has them: the settings always, the
# credentials only into local processes (never written into a manifest in clear text)
MLFLOW_FORWARDED = (MLFLOW_TRACKING_URI, MLFLOW_RUN_ID, MLFLOW_EXPERIMENT_ID,
                    MLFLOW_EXPERIMENT_NAME, MLFLOW_WORKSPACE, MLFLOW_TRACKING_AUTH,
                    MLFLOW_TRACKING_INSECURE_TLS, MLFLOW_TRACKING_SERVER_CERT_PATH)
MLFLOW_CREDENTIALS = (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD)
# mlflow v3.17.2, mlflow/environment_variables.py: lets the client write a local folder store
# (mlflow/store/tracking/file_store.py refuses one without it); a user's script is pointed at one
# when the tracking server does not answer (pipelines/script/track.py)
MLFLOW_ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
# mlflow v3.17.2, mlflow/environment_variables.py: the client's HTTP retries (default 7, backoff
# factor 2: minutes against a dead server) and timeout (default 120 s); the trainer lowers them
# unless the user set them, so a dead server costs seconds, not epochs.
MLFLOW_HTTP_REQUEST_MAX_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR = "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
MLFLOW_HTTP_REQUEST_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"
