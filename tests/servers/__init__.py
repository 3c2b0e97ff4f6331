"""Real servers for the production adapters' tests, one pytest plugin each (registered in tests/conftest.py).

A package, so that no module here (redis.py, ...) can ever shadow the client library of its name."""
