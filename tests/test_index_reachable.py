"""scripts/index_reachable.py: the Makefile's check before it uses PyTorch's CPU-only index."""

from __future__ import annotations

import http.server
import importlib.util
import threading
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "index_reachable.py"


def _load():
    spec = importlib.util.spec_from_file_location("index_reachable", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_index_that_serves_torch_is_reachable(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<a>torch-2.13.0+cpu.whl</a>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        module = _load()
        assert module.reachable(url) is True
        (tmp_path / "torch" / "index.html").unlink()
        (tmp_path / "torch").rmdir()
        assert module.reachable(url) is False  # 404: no torch page there
    finally:
        server.shutdown()


def test_an_unreachable_or_malformed_index_is_not():
    module = _load()
    assert module.reachable("http://127.0.0.1:9", timeout_s=2) is False
    assert module.reachable("not a url") is False
