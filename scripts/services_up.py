"""Exit 0 when PostgreSQL (5432) and Redis (6379) answer on 127.0.0.1."""

import socket
import sys

for port in (5432, 6379):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        sys.exit(1)
sys.exit(0)
