"""Exchange federation (docs/federation.md, seed 002): a downstream broker subscribes to
an upstream broker's exchange with the bindings its own clients made, and receives
exactly the messages they ask for, at least once, with duplicates dropped on arrival."""
