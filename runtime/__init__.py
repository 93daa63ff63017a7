"""What every role's process needs besides the protocol: loading its config, and the coordinator's HTTP client."""
