"""The ``ulysses-sp`` command line."""
