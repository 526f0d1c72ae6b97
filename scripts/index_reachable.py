"""Exit 0 when a package index answers within a few seconds, 1 otherwise (used by the Makefile)."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def reachable(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``url``'s torch page answers (any HTTP status below 400) within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout_s) as reply:
            return bool(reply.status < 400)
    except (OSError, ValueError, urllib.error.URLError):
        return False


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and reachable(sys.argv[1]) else 1)
