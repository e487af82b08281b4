"""The control plane and what joins it: Nodes (API-only, KWOK's, Karpenter's, a real one) and
archway installed by its chart. It may use lab/servers/; lab/__init__.py has the floors."""
