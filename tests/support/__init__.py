"""What tests share: the coordinator harness (`coordinator`), checkpoint-transfer fixtures (`transfer`), the
PostgreSQL test server (`postgres`), an in-process stand-in for the trainer's coordinator API (`trainer`) and a
real node run in a thread (`node`).
Fixtures built on them live in tests/conftest.py; no test module imports another."""
