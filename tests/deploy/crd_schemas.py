"""Offline schemas of the custom resources in deploy/: KServe's ServingRuntime and
InferenceService (deploy/kserve.yaml) and the LeaderWorkerSet (deploy/lws-two-hosts.yaml).

kubernetes-validate bundles only the Kubernetes API, not these CRDs (each is hundreds of KB).
So the fields shardserve's manifests use are written out here, strict (``additionalProperties:
false``; names and types as in kserve ``config/crd/full`` and lws ``config/crd/bases``), and every
embedded Kubernetes object (Container, PodTemplateSpec, Volume, ...) is a ``$ref`` into the
bundled strict Kubernetes definitions of the version asked for: the same validator, the same
registry as ``kubernetes_validate.validate``.

    validate_crd(doc, "1.29.0")      # raises kubernetes_validate.ValidationError
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate import utils
from referencing import Registry, Resource

DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def _core(name: str) -> dict[str, str]:
    return {"$ref": f"{DEFS}io.k8s.api.core.v1.{name}"}


def _obj(properties: dict[str, Any], *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"$ref": f"{DEFS}io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
_PROTOCOL = {"type": "string", "enum": ["v1", "v2", "grpc-v1", "grpc-v2"]}

_POD_FIELDS = {  # ServingRuntimePodSpec / the predictor's pod fields used or likely to be
    "containers": {"type": "array", "items": _core("Container")},
    "volumes": {"type": "array", "items": _core("Volume")},
    "nodeSelector": _MAP,
    "affinity": _core("Affinity"),
    "tolerations": {"type": "array", "items": _core("Toleration")},
    "imagePullSecrets": {"type": "array", "items": _core("LocalObjectReference")},
    "labels": _MAP,
    "annotations": _MAP,
}

SERVING_RUNTIME = _obj(
    {
        "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
        "kind": {"const": "ServingRuntime"},
        "metadata": _META,
        "spec": _obj(
            {
                **_POD_FIELDS,
                "supportedModelFormats": {
                    "type": "array",
                    "items": _obj(
                        {"name": _STR, "version": _STR, "autoSelect": _BOOL, "priority": _INT},
                        required=("name",),
                    ),
                },
                "protocolVersions": {"type": "array", "items": _PROTOCOL},
                "multiModel": _BOOL,
                "disabled": _BOOL,
                "grpcEndpoint": _STR,
                "httpDataEndpoint": _STR,
            },
            required=("containers",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

_MODEL = _obj(
    {
        "modelFormat": _obj({"name": _STR, "version": _STR}, required=("name",)),
        "runtime": _STR,
        "protocolVersion": _PROTOCOL,
        "storageUri": _STR,
        "args": {"type": "array", "items": _STR},
        "env": {"type": "array", "items": _core("EnvVar")},
        "resources": _core("ResourceRequirements"),
    },
    required=("modelFormat",),
)

INFERENCE_SERVICE = _obj(
    {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": _META,
        "spec": _obj(
            {
                "predictor": _obj(
                    {
                        **_POD_FIELDS,
                        "model": _MODEL,
                        "minReplicas": {"type": "integer", "minimum": 0},
                        "maxReplicas": {"type": "integer", "minimum": 0},
                        "scaleMetric": {"type": "string", "enum": ["cpu", "memory", "concurrency", "rps"]},
                        "scaleTarget": _INT,
                        "containerConcurrency": _INT,
                        "timeout": _INT,
                        "serviceAccountName": _STR,
                    }
                )
            },
            required=("predictor",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

_POD_TEMPLATE = {"$ref": f"{DEFS}io.k8s.api.core.v1.PodTemplateSpec"}

LEADER_WORKER_SET = _obj(
    {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": _META,
        "spec": _obj(
            {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"type": "string", "enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": _obj(
                    {
                        "type": {"type": "string", "enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": _obj(
                            {
                                "maxUnavailable": {"type": ["integer", "string"]},
                                "maxSurge": {"type": ["integer", "string"]},
                            }
                        ),
                    }
                ),
                "networkConfig": _obj(
                    {"subdomainPolicy": {"type": "string", "enum": ["Shared", "UniquePerReplica"]}}
                ),
                "leaderWorkerTemplate": _obj(
                    {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"type": "string", "enum": ["RecreateGroupOnPodRestart", "None"]},
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                    },
                    required=("workerTemplate",),
                ),
            },
            required=("leaderWorkerTemplate",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

SCHEMAS = {
    "ServingRuntime": SERVING_RUNTIME,
    "InferenceService": INFERENCE_SERVICE,
    "LeaderWorkerSet": LEADER_WORKER_SET,
}
CRD_GROUPS = ("serving.kserve.io/", "leaderworkerset.x-k8s.io/")


def is_crd(doc: dict[str, Any]) -> bool:
    return str(doc.get("apiVersion", "")).startswith(CRD_GROUPS)


def validate_crd(doc: dict[str, Any], version: str) -> None:
    """Validate a custom resource as ``kubernetes_validate.validate(doc, version, strict=True)`` does."""
    schema = SCHEMAS.get(doc.get("kind", ""))
    if schema is None:
        raise kubernetes_validate.SchemaNotFoundError(
            version=version, kind=doc.get("kind"), api_version=doc.get("apiVersion")
        )
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    definitions = utils.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ Registry()
    try:
        jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(doc)
    except jsonschema.ValidationError as err:
        raise kubernetes_validate.ValidationError(err, version=version) from None
