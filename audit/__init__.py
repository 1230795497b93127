"""Replication audits: the audit record schema brokers write and the Spark job reads."""
