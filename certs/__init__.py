"""Certificates for archway: generation, the in-cluster bootstrap, the embedded self-signed
default, and a server TLS context that follows a certificate rotated on disk."""
