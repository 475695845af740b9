"""Tokenizers that instances publish and gateways fetch (`pdplane.v1.TokenizerFiles`)."""
