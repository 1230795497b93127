"""The ValidatingAdmissionPolicy that keeps a BrokerCluster from being a way around RBAC.

The operator acts with its own rights: it creates the pods a BrokerCluster describes
(images its author names) and mounts the Secrets it names. Without a check, a user who
may create BrokerClusters but not pods, or not read a Secret, could get both through the
operator. The API server's own authorizer answers for the author at admission (CEL's
`authorizer`): a BrokerCluster is admitted only if its author may

- create pods in its namespace (the brokers' and the audit runs' images are theirs to
  name; the audit's ServiceAccount is one such pod's), and
- read every Secret it names: `auth.secretName`, `audit.storeSecretName`,
  `mirror.secretName`, `tls.secretName`, `tls.clientCertificates.caSecretName` (whose
  bundle decides which applications get in), each federation upstream's `passwordSecret`
  and `tls.clientSecret` (a client certificate's key is a credential too), and the
  `<name>-auth` Secret of a same-namespace BrokerCluster an upstream refers to without
  one (the operator would mount that cluster's password);
- create cert-manager Certificates in its namespace when it names an issuer
  (`tls.issuerRef`: the operator creates a Certificate naming it, and cert-manager lets
  whoever may create one use any ClusterIssuer);

and, when the chart lists allowed image prefixes (`admissionPolicy.allowedImagePrefixes`),
only if the brokers' and the audit's images start with one of them.

`python -m twinmq.operator.admission > helm/twinmq/templates/admission-policy.yaml`
writes the chart's template (`tests/test_admission.py` keeps it current and proves the
policy on a real API server).
"""

from __future__ import annotations

from typing import Any

import yaml

from twinmq.operator.models import GROUP, PLURAL

Obj = dict[str, Any]

POLICY_NAME = "twinmq-brokercluster-rbac"

_SECRETS = (
    "(has(object.spec.auth) && has(object.spec.auth.secretName)"
    " ? [object.spec.auth.secretName] : [])"
    " + (has(object.spec.audit) && has(object.spec.audit.storeSecretName)"
    " ? [object.spec.audit.storeSecretName] : [])"
    " + (has(object.spec.mirror) && has(object.spec.mirror.secretName)"
    " ? [object.spec.mirror.secretName] : [])"
    " + (has(object.spec.tls) && has(object.spec.tls.secretName)"
    " ? [object.spec.tls.secretName] : [])"
    " + (has(object.spec.tls) && has(object.spec.tls.clientCertificates)"
    " && has(object.spec.tls.clientCertificates.caSecretName)"
    " ? [object.spec.tls.clientCertificates.caSecretName] : [])"
    " + (has(object.spec.federation) && has(object.spec.federation.upstreams)"
    " ? object.spec.federation.upstreams.map(u,"
    " has(u.passwordSecret) ? u.passwordSecret.name"
    " : (has(u.clusterRef) && !has(u.clusterRef.namespace) ? u.clusterRef.name + '-auth' : ''))"
    " : [])"
    " + (has(object.spec.federation) && has(object.spec.federation.upstreams)"
    " ? object.spec.federation.upstreams.map(u,"
    " has(u.tls) && has(u.tls.clientSecret) ? u.tls.clientSecret : '')"
    " : [])"
)


def _may(verb: str, resource: str, name: str | None = None, group: str = "") -> str:
    check = (
        f"authorizer.group('{group}').resource('{resource}').namespace(object.metadata.namespace)"
    )
    if name is not None:
        check += f".name({name})"
    return f"{check}.check('{verb}').allowed()"


_IMAGES = (
    "([object.spec.image] + (has(object.spec.audit) && has(object.spec.audit.image)"
    " ? [object.spec.audit.image] : [])).map(i,"
    # Normalised as the container runtime reads them: a first component that is not a
    # host (no '.' or ':', not localhost) means Docker Hub, so a prefix list cannot be
    # passed by leaving the registry out (`twinmq/twinmq` is docker.io/twinmq/twinmq).
    " i.split('/')[0].contains('.') || i.split('/')[0].contains(':')"
    " || i.split('/')[0] == 'localhost' ? i"
    " : (i.contains('/') ? 'docker.io/' + i : 'docker.io/library/' + i))"
)

CHART_ALLOWED_IMAGES = "{{ toJson (.Values.admissionPolicy.allowedImagePrefixes | default list) }}"
"""The chart's allow-list of image prefixes as a CEL list (JSON is one), rendered by Helm."""


def policy(allowed_images: str = "[]") -> Obj:
    """The ValidatingAdmissionPolicy (see the module). `allowed_images`: a CEL list of
    image prefixes (registries, `registry/org/`) the brokers' and audits' images must
    start with; empty, any image."""
    outside = "variables.images.filter(i, !variables.allowedImages.exists(p, i.startsWith(p)))"
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [GROUP],
                        "apiVersions": ["*"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": [PLURAL],
                    }
                ]
            },
            "variables": [
                {"name": "secrets", "expression": _SECRETS},
                {"name": "named", "expression": "variables.secrets.filter(n, n != '')"},
                # One check when the author may read every Secret of the namespace; else one
                # per name, a validation each (`_readable`).
                {"name": "readsAll", "expression": _may("get", "secrets")},
                {"name": "images", "expression": _IMAGES},
                {"name": "allowedImages", "expression": allowed_images},
            ],
            "validations": [
                {
                    "expression": _may("create", "pods"),
                    "messageExpression": "'a BrokerCluster runs pods of the images it names: "
                    "you (' + request.userInfo.username + ') may not create pods in ' "
                    "+ object.metadata.namespace",
                    "reason": "Forbidden",
                },
                {
                    "expression": "!has(object.spec.tls) || !has(object.spec.tls.issuerRef) || "
                    + _may("create", "certificates", group="cert-manager.io"),
                    "messageExpression": "'a BrokerCluster with tls.issuerRef has the operator "
                    "create a cert-manager Certificate: you (' + request.userInfo.username + ') "
                    "may not create certificates.cert-manager.io in ' + object.metadata.namespace",
                    "reason": "Forbidden",
                },
                *_readable(),
                {
                    "expression": f"size(variables.allowedImages) == 0 || size({outside}) == 0",
                    "messageExpression": f"'images must come from an allowed registry (' "
                    f"+ variables.allowedImages.join(', ') + '): not ' + {outside}.join(', ')",
                    "reason": "Forbidden",
                },
            ],
        },
    }


MAX_SECRETS = 5 + 2 * 16
"""The most Secrets a BrokerCluster names: auth, audit store, mirror, TLS, the client CA
bundle, and a password
and a client certificate for each of at most 16 federation upstreams."""


def _readable() -> list[Obj]:
    """The validations that the author may read every Secret named: one name each (an
    authorizer check costs about a third of an expression's CEL budget, and the first
    validation also pays for `readsAll`)."""
    return [
        {
            "expression": f"variables.readsAll || size(variables.named) <= {i} || "
            + _may("get", "secrets", f"variables.named[{i}]"),
            # The message cannot ask the authorizer: it lists every Secret named.
            "messageExpression": "'a BrokerCluster may name only Secrets its author may "
            "read; you (' + request.userInfo.username + ') may not read one of: ' "
            "+ variables.named.join(', ')",
            "reason": "Forbidden",
        }
        for i in range(MAX_SECRETS)
    ]


def binding() -> Obj:
    """Its binding: every namespace, refusals denied."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
    }


def chart_template() -> str:
    """The chart's template: both objects, with the operator, with cluster-wide RBAC (a
    namespace-scoped install makes nothing cluster-wide), and `admissionPolicy.enabled`."""
    body = yaml.safe_dump_all([policy(CHART_ALLOWED_IMAGES), binding()], sort_keys=False, width=100)
    return (
        "# Generated by `python -m twinmq.operator.admission` (operator/admission.py): "
        "do not edit.\n"
        "{{- if and .Values.admissionPolicy.enabled .Values.operator.enabled"
        ' (eq (include "twinmq.rbacScope" .) "cluster") }}\n' + body + "{{- end }}\n"
    )


if __name__ == "__main__":
    print(chart_template(), end="")
