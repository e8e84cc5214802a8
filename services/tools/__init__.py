"""A small tools service: each tool answers NATS requests on `tool.call.<name>`."""
