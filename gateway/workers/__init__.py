"""``--workers N``: N gateway processes on one port (see :mod:`gateway.workers.pool`)."""
