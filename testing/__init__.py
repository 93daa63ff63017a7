"""Test and benchmark support shipped with the package: adversarial nodes that speak the real protocol."""
