"""The message contract: envelope, payloads, subjects and history records.

This package is the only place a message shape is defined. JSON Schema files
exported from it (`schemas/json/`) let a service in another language join.
"""
