"""Servers on loopback that archway is tried against: real ones it starts (a registry,
Prometheus) and stand-ins (an API server, a token server, file servers, hostile peers).
The floor above the ground floor (lab/__init__.py)."""
