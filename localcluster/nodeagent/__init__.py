"""The process-backed node agent: test infrastructure standing in for the kubelet.

It registers a Node and runs each pod bound to it as local processes in the
pod's own network namespace (CNI `bridge` + `host-local`), like kwok or
virtual-kubelet would stand in for a real node. Nothing in TwinMQ's operator
or chart knows it exists. See docs/local-cluster.md.
"""
