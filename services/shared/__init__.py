"""Plumbing every service shares: NATS bus, JetStream layout, settings, logging,
and the process runner (signals, micro-service registration, draining)."""
