"""Command-line tools: the demo, and (later) the kubectl plugin and the audit runner."""
