"""What every part agrees on about an instance: spec and load validation (`validation`), which
roles and pairs may serve and exchange KV (`pairing`), KV layout fingerprints (`layout`), the
log of which instances changed at which revision (`change_log`)."""
