"""Starting and supervising pdplane's own processes and vLLM instances on one machine."""
