"""The verifier role: checks every submitted group on the trusted side before it can reach the trainer."""
