"""The compaction decider: watches generations, decides when a session must
be compacted, and asks the generator to do it."""
