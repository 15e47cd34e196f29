"""masc scan against an in-process masc serve (a real socket on loopback), for the scan tests."""

from masc_gadget.config import load_config
from masc_gadget.serving.server import MascServer
from sim_scanner.scanner.session import run_scan

from tests.conftest import CONFIGS


def scan_against_serve(dataset, out, gadget=(), scan=(), config="tiny.yaml"):
    """Start masc serve with ``config`` and the ``gadget`` overrides, scan the test split of
    ``dataset`` into ``out`` with the ``scan`` overrides, stop the server; (report, scan config)."""
    server = MascServer(load_config(CONFIGS / config, ["gadget.device=cpu", *gadget]), address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        scan_config = load_config(CONFIGS / config, [f"scanner.server=127.0.0.1:{port}", "scanner.deadline_ms=5000",
                                                     *scan])
        return run_scan(scan_config, dataset, "test", out, progress=False), scan_config
    finally:
        server.shutdown()
