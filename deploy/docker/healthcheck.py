#!/usr/bin/env python3
"""The images' HEALTHCHECK: exit 0 when GET URL answers 200 within 2 s, else 1.

URL: the first argument, else $EDGECLOUD_HEALTH_URL (each image sets it for its role's port).

Standard library only, so it runs in every image whatever is installed there.
"""

import os
import sys
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("EDGECLOUD_HEALTH_URL", "")

if not URL.startswith("http://"):
    sys.exit(f"usage: edgecloud-healthcheck http://127.0.0.1:PORT/PATH (got {URL!r})")
try:
    with urllib.request.urlopen(URL, timeout=2) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as exc:
    print(f"unhealthy: {URL}: {exc}", file=sys.stderr)
    sys.exit(1)
