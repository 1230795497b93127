"""A local Kubernetes for TwinMQ's tests and demo.

Real control-plane binaries (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kube-proxy, CoreDNS) built from their Go modules, plus a
*process-backed node agent*: test infrastructure standing in for the
kubelet and its container runtime (like kwok or virtual-kubelet). The
operator and the chart never know it exists.
"""
