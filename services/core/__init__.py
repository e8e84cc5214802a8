"""The pure decision core: state transitions, prompt rendering and sizing, token
estimates, when to compact, where the boundary falls, and the splice.

Nothing in this package performs I/O or touches asyncio or NATS; the services
are thin shells that feed it plain data and act on what it returns.
"""
