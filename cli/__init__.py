"""Command-line tools: the audit runner and the kubectl plugin (`kubectl twinmq`)."""
