"""Plain types, errors and conversions shared by every pdplane service and the connector.

Keep this package light: the KV connector imports it inside vLLM's engine process.
"""
