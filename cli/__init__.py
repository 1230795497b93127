"""Command-line tools: the demo, the audit runner and the kubectl plugin (`kubectl twinmq`)."""
