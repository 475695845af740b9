"""KV cache events as pdplane publishes them: the publisher's log and snapshots (`log`), the
`KvEvents` servicers (`server`), the columnar form of single-block stores (`columns`)."""
