"""The generator: answers queries with the model, keeps history in JetStream,
and executes compactions, one session at a time under its durable lock."""
