"""The proto of every record a worker sends (guard.proto) and its generated code (`make proto`)."""
