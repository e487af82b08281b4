"""The scheduler extender: filter nodes by architecture, score them by network traffic."""
