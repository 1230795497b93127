"""The TwinMQ operator: BrokerCluster resources, failover, the virtual-IP Service."""
