"""Compact schemas of the Kubernetes objects in examples/clusters/, and a validator that walks a manifest against them.

Written for accel's tests from these sources (read, not copied; each object lists every field its source allows, with
the type, the required fields and the values an enum-like string takes):

- TrainJob (trainer.kubeflow.org/v1alpha1): kubeflow/trainer, tag v2.3.0, commit
  658725bdae5c7e3a0854d93ac6ff492e109a22ab, manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml (the same spec
  fields at main 8c0f5059 of 2026-08-21; v2.0 and v2.1 differ: numProcPerNode int-or-string, podSpecOverrides or
  podTemplateOverrides, no runtimePatches); the name rule from its CEL validations, the runtime kinds from
  pkg/apis/trainer/v1alpha1/trainingruntime_types.go.
- PyTorchJob (kubeflow.org/v1): kubeflow/training-operator, branch release-1.9, commit
  078ec30ff26649a07d2e28893c332d4cef70e233, manifests/base/crds/kubeflow.org_pytorchjobs.yaml; its restartPolicy values
  from pkg/apis/kubeflow.org/v1/common_types.go; the replica types (Master, Worker) from the webhook,
  pkg/webhooks/pytorch/pytorchjob_webhook.go (which also wants Master replicas 1 and a container named pytorch with an
  image: checked by the test, not by this schema).
- RayJob (ray.io/v1): ray-project/kuberay, tag v1.7.0, commit 59d663aeec13760646da3db9c1cf8cfe883e30b7,
  ray-operator/config/crd/bases/ray.io_rayjobs.yaml (its descriptions are stripped: submissionMode's values from
  ray-operator/apis/ray/v1/rayjob_types.go, the name's limit of 47 from controllers/ray/utils/validation.go and
  constant.go, the positive deadlines from validation.go).
- Kubernetes core/v1 (PodTemplateSpec, PodSpec, Container, ResourceRequirements, EnvVar, ContainerPort) as those CRDs
  embed it: the PyTorchJob CRD's copy is an older Kubernetes (PodSpec without resources, hostnameOverride,
  schedulingGroup; Container without restartPolicyRules), KubeRay's the newer. Enum values from the field descriptions.

An object the examples do not use the inside of (affinity, volumes, runPolicy, ...) is described only as an object
(OPAQUE): a manifest that puts anything in it fails as "not described here", so using a new object means describing
it first. ObjectMeta is not in the CRDs (the API server checks it): the fields here are the ones a manifest sets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Union


@dataclass(frozen=True)
class Str:
    pattern: str | None = None
    max_length: int | None = None


@dataclass(frozen=True)
class Int:
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True)
class Scalar:
    type: str  # "boolean", "number" or "quantity" (an integer, or a string such as 500m or 4Gi)


@dataclass(frozen=True)
class Enum:
    values: tuple[str, ...]


@dataclass(frozen=True)
class ListOf:
    items: Spec


@dataclass(frozen=True)
class MapOf:
    values: Spec
    keys: tuple[str, ...] | None = None  # None: any key


@dataclass(frozen=True)
class Obj:
    fields: Mapping[str, Spec] | None  # None: only "an object", its fields not described here
    required: tuple[str, ...] = field(default=())


Spec = Union[Str, Int, Scalar, Enum, ListOf, MapOf, Obj]

STR, INT, BOOL, NUMBER, QUANTITY = Str(), Int(), Scalar("boolean"), Scalar("number"), Scalar("quantity")
OPAQUE = Obj(None)
DNS1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"  # a job's name (TrainJob's CEL rule, the PyTorchJob and KubeRay validations)
DNS1123 = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # a container's name
QUANTITY_PATTERN = (r"(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
                    r"|(\.[0-9]+))))?")  # the resource.Quantity pattern of the CRDs' limits/requests


def of(spec: Spec, names: str) -> dict[str, Spec]:
    """The same spec for each of the space-separated field names."""
    return dict.fromkeys(names.split(), spec)


def object_meta(max_name: int) -> Obj:
    return Obj({"name": Str(DNS1035, max_name), "generateName": STR, "namespace": STR, "labels": MapOf(STR),
                "annotations": MapOf(STR), "finalizers": ListOf(STR)})


# ---- Kubernetes core/v1, as the CRDs embed it ----
TEMPLATE_META = Obj({**of(MapOf(STR), "labels annotations"), "finalizers": ListOf(STR), **of(STR, "name namespace")})
RESOURCES = Obj({"claims": ListOf(OPAQUE), **of(MapOf(QUANTITY), "limits requests")})
ENV_VAR = Obj({"name": STR, "value": STR, "valueFrom": OPAQUE}, required=("name",))
PORT = Obj({"containerPort": Int(1, 65535), "hostIP": STR, "hostPort": Int(1, 65535), "name": Str(max_length=15),
            "protocol": Enum(("TCP", "UDP", "SCTP"))}, required=("containerPort",))
CONTAINER_FIELDS: dict[str, Spec] = {
    **of(ListOf(STR), "args command"), "env": ListOf(ENV_VAR), "ports": ListOf(PORT),
    **of(ListOf(OPAQUE), "envFrom resizePolicy volumeDevices volumeMounts"),
    "name": Str(DNS1123, 63), **of(STR, "image terminationMessagePath workingDir"),
    "imagePullPolicy": Enum(("Always", "Never", "IfNotPresent")),
    "terminationMessagePolicy": Enum(("File", "FallbackToLogsOnError")),
    "restartPolicy": STR,  # init containers only (sidecars); the values vary with the Kubernetes version
    "resources": RESOURCES, **of(OPAQUE, "lifecycle livenessProbe readinessProbe securityContext startupProbe"),
    **of(BOOL, "stdin stdinOnce tty"),
}
POD_SPEC_FIELDS: dict[str, Spec] = {
    **of(INT, "activeDeadlineSeconds priority terminationGracePeriodSeconds"),
    **of(OPAQUE, "affinity dnsConfig os securityContext"),
    **of(BOOL, "automountServiceAccountToken enableServiceLinks hostIPC hostNetwork hostPID hostUsers "
               "setHostnameAsFQDN shareProcessNamespace"),
    **of(ListOf(OPAQUE), "ephemeralContainers hostAliases imagePullSecrets readinessGates resourceClaims "
                         "schedulingGates tolerations topologySpreadConstraints volumes"),
    **of(STR, "hostname nodeName priorityClassName runtimeClassName schedulerName serviceAccount serviceAccountName "
              "subdomain"),
    "dnsPolicy": Enum(("ClusterFirstWithHostNet", "ClusterFirst", "Default", "None")),
    "preemptionPolicy": Enum(("Never", "PreemptLowerPriority")),
    "restartPolicy": Enum(("Always", "OnFailure", "Never")),
    "nodeSelector": MapOf(STR), "overhead": MapOf(QUANTITY),
}


def pod_template(newer: bool) -> Obj:
    """PodTemplateSpec; newer: the Kubernetes of KubeRay's CRD, with the fields the PyTorchJob CRD's lacks."""
    container = Obj({**CONTAINER_FIELDS, **({"restartPolicyRules": ListOf(OPAQUE)} if newer else {})},
                    required=("name",))
    extra: dict[str, Spec] = ({"resources": RESOURCES, "hostnameOverride": STR, "schedulingGroup": OPAQUE}
                              if newer else {})
    spec = Obj({**POD_SPEC_FIELDS, **extra, **of(ListOf(container), "containers initContainers")},
               required=("containers",))
    return Obj({"metadata": TEMPLATE_META, "spec": spec})


def job(api_version: str, kind: str, max_name: int, spec: Obj) -> Obj:
    """A top-level object: apiVersion, kind and metadata.name the API server wants, spec required here."""
    return Obj({"apiVersion": Enum((api_version,)), "kind": Enum((kind,)), "metadata": object_meta(max_name),
                "spec": spec, "status": OPAQUE}, required=("apiVersion", "kind", "metadata", "spec"))


# ---- TrainJob, kubeflow/trainer v2.3.0 ----
TRAINJOB = job("trainer.kubeflow.org/v1alpha1", "TrainJob", 63, Obj({
    "activeDeadlineSeconds": Int(1), "initializer": OPAQUE, "runtimePatches": ListOf(OPAQUE), "suspend": BOOL,
    "managedBy": Enum(("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")),
    "runtimeRef": Obj({"apiGroup": STR, "kind": Enum(("ClusterTrainingRuntime", "TrainingRuntime")),
                       "name": STR}, required=("name",)),
    "trainer": Obj({**of(ListOf(STR), "args command"), "env": ListOf(ENV_VAR), "image": STR, "numNodes": Int(0),
                    "numProcPerNode": Int(1), "resourcesPerNode": RESOURCES}),
}, required=("runtimeRef",)))

# ---- PyTorchJob, kubeflow/training-operator release-1.9 ----
REPLICA_SPEC = Obj({"replicas": Int(0), "restartPolicy": Enum(("Always", "OnFailure", "Never", "ExitCode")),
                    "template": pod_template(newer=False)})
PYTORCHJOB = job("kubeflow.org/v1", "PyTorchJob", 63, Obj({
    "elasticPolicy": OPAQUE, "runPolicy": OPAQUE,
    "nprocPerNode": STR,  # a string in v1 ("4", "auto", "gpu")
    "pytorchReplicaSpecs": MapOf(REPLICA_SPEC, keys=("Master", "Worker")),
}, required=("pytorchReplicaSpecs",)))

# ---- RayJob, ray-project/kuberay v1.7.0 ----
RAY_MANAGED_BY = Enum(("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"))
RAY_GROUP_COMMON: dict[str, Spec] = {**of(MapOf(STR), "labels rayStartParams resources"),
                                     "template": pod_template(newer=True)}
HEAD_GROUP = Obj({**RAY_GROUP_COMMON, "enableIngress": BOOL, **of(OPAQUE, "headService ingressOptions"),
                  "serviceType": Enum(("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"))},
                 required=("template",))
WORKER_GROUP = Obj({**RAY_GROUP_COMMON, "groupName": STR, "idleTimeoutSeconds": INT, "numOfHosts": INT,
                    "priority": INT, **of(Int(0), "maxReplicas minReplicas replicas"), "scaleStrategy": OPAQUE,
                    "suspend": BOOL}, required=("groupName", "maxReplicas", "minReplicas", "template"))
RAY_CLUSTER_SPEC = Obj({
    **of(OPAQUE, "authOptions autoscalerOptions gcsFaultToleranceOptions historyServerOptions networkPolicy "
                 "tlsOptions upgradeStrategy"),
    "enableInTreeAutoscaling": BOOL, "suspend": BOOL, "rayVersion": STR, "managedBy": RAY_MANAGED_BY,
    "headGroupSpec": HEAD_GROUP, "headServiceAnnotations": MapOf(STR), "workerGroupSpecs": ListOf(WORKER_GROUP),
}, required=("headGroupSpec",))
RAYJOB = job("ray.io/v1", "RayJob", 47, Obj({
    "activeDeadlineSeconds": Int(1), "preRunningDeadlineSeconds": Int(1), "backoffLimit": Int(0),
    "ttlSecondsAfterFinished": Int(0), **of(MapOf(STR), "clusterSelector metadata"), "deletionStrategy": OPAQUE,
    **of(STR, "entrypoint entrypointResources jobId runtimeEnvYAML"),
    **of(NUMBER, "entrypointNumCpus entrypointNumGpus"),
    "managedBy": RAY_MANAGED_BY, "rayClusterSpec": RAY_CLUSTER_SPEC, **of(BOOL, "shutdownAfterJobFinishes suspend"),
    "submissionMode": Enum(("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")),
    **of(OPAQUE, "submitterConfig submitterPodTemplate"),
}))

SCHEMAS = {"TrainJob": TRAINJOB, "PyTorchJob": PYTORCHJOB, "RayJob": RAYJOB}


def validate(value: Any, spec: Spec, path: str = "") -> list[str]:
    """Every problem of value against spec, each as "path: what" (path as in kubectl: spec.a.b[0].c)."""
    where = path or "(top)"
    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        if spec.fields is None:
            return [f"{where}: not described in tests/unit/k8s_schemas.py; describe its fields before using it"] \
                if value else []
        errors = [f"{path}.{name}".lstrip(".") + ": required field missing" for name in spec.required
                  if name not in value]
        for name, item in value.items():
            inner = f"{path}.{name}".lstrip(".")
            if name not in spec.fields:
                errors.append(f"{inner}: unknown field (allowed: {', '.join(sorted(spec.fields))})")
            else:
                errors += validate(item, spec.fields[name], inner)
        return errors
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            return [f"{where}: expected a map, got {type(value).__name__}"]
        errors = []
        for key, item in value.items():
            if spec.keys is not None and key not in spec.keys:
                errors.append(f"{path}.{key}: unknown key (allowed: {', '.join(spec.keys)})")
            errors += validate(item, spec.values, f"{path}.{key}")
        return errors
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [error for i, item in enumerate(value) for error in validate(item, spec.items, f"{path}[{i}]")]
    if isinstance(spec, Enum):
        return [] if value in spec.values else [f"{where}: {value!r} is not one of {', '.join(spec.values)}"]
    if isinstance(spec, Str):
        if not isinstance(value, str):
            return [f"{where}: expected a string, got {type(value).__name__} {value!r}"]
        if spec.pattern is not None and not re.fullmatch(spec.pattern, value):
            return [f"{where}: {value!r} does not match {spec.pattern}"]
        if spec.max_length is not None and len(value) > spec.max_length:
            return [f"{where}: {value!r} is longer than {spec.max_length} characters"]
        return []
    if isinstance(spec, Int):
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{where}: expected an integer, got {type(value).__name__} {value!r}"]
        if (spec.minimum is not None and value < spec.minimum) or (spec.maximum is not None and value > spec.maximum):
            return [f"{where}: {value} is outside [{spec.minimum}, {spec.maximum}]"]
        return []
    ok = {"boolean": isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "quantity": (isinstance(value, int) and not isinstance(value, bool))
          or (isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value) is not None)}[spec.type]
    return [] if ok else [f"{where}: expected a {spec.type}, got {type(value).__name__} {value!r}"]


def validate_manifest(manifest: Any) -> list[str]:
    """The manifest against the schema of its kind; an unknown kind is one problem."""
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind not in SCHEMAS:
        return [f"kind: {kind!r} has no schema here (known: {', '.join(SCHEMAS)})"]
    return validate(manifest, SCHEMAS[kind])
