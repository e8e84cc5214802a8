"""The gateway: HTTP API and web page in front of the NATS services."""
