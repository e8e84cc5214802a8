"""The three services (gateway, generator, compaction-decider), the tools
service, the pure decision core they share, and their common plumbing."""
