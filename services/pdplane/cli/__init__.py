"""The `pdplane` command line."""
