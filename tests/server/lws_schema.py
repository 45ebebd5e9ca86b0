"""A JSON schema of the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) as its controller's API
types declare it (kubernetes-sigs/lws, api/leaderworkerset/v1), for the chart's test: no
package ships the CRD's schema where this project can install from. Unknown fields are refused,
as `kubectl apply`'s strict field validation refuses them. The pod templates are checked as
PodTemplates against the Kubernetes schemas by the test, so here they are objects."""

from __future__ import annotations

INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9]+%?$"}]}
OBJECT_META = {"type": "object"}  # checked by the Kubernetes schemas through the PodTemplate


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


POD_TEMPLATE_SPEC = _closed({"metadata": OBJECT_META, "spec": {"type": "object"}})

LEADER_WORKER_TEMPLATE = _closed(
    {
        "leaderTemplate": POD_TEMPLATE_SPEC,
        "workerTemplate": POD_TEMPLATE_SPEC,
        "size": {**INT32, "minimum": 1},
        "restartPolicy": {
            "enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
        },
        "subGroupPolicy": _closed(
            {
                "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                "subGroupSize": {**INT32, "minimum": 1},
            }
        ),
        "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}},
        "persistentVolumeClaimRetentionPolicy": _closed(
            {"whenDeleted": {"type": "string"}, "whenScaled": {"type": "string"}}
        ),
    },
    required=("workerTemplate",),
)

LEADER_WORKER_SET = _closed(
    {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": _closed(
            {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            required=("name",),
        ),
        "spec": _closed(
            {
                "replicas": {**INT32, "minimum": 0},
                "leaderWorkerTemplate": LEADER_WORKER_TEMPLATE,
                "rolloutStrategy": _closed(
                    {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": _closed(
                            {
                                "partition": {**INT32, "minimum": 0},
                                "maxUnavailable": INT_OR_STRING,
                                "maxSurge": INT_OR_STRING,
                            }
                        ),
                    },
                    required=("type",),
                ),
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": _closed(
                    {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                    required=("subdomainPolicy",),
                ),
            },
            required=("leaderWorkerTemplate",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)
