"""KV cache events as pdplane publishes them: the publisher's log and snapshots (`log`), the
`KvEvents` servicers (`servicer`), the columnar form of single-block stores (`columns`)."""
