"""Malicious nodes that speak the real protocol to a real coordinator, and the harness that runs them."""
