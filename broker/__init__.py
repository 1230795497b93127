"""TwinMQ broker: an AMQP 0-9-1 server with a crash-safe journal."""
