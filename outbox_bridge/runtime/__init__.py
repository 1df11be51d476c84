"""The runtime: the bridge that finds shards with rows, the drains that run handlers, and
the worker that wires them to Temporal."""
