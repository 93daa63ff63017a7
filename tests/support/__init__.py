"""What tests share: the coordinator harness (`coordinator`), checkpoint-transfer fixtures (`transfer`), the
PostgreSQL test server (`postgres`), an in-process stand-in for the trainer's coordinator API (`trainer`), a real
node run in a thread (`node`) and docker/setup_pool.py's configs written without a model (`pool_setup`).
Fixtures built on them live in tests/conftest.py; no test module imports another."""
