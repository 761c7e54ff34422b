"""The inventory service: GET /stock/<sku> -> {"sku": ..., "on_hand": ...}; 404 for an unknown sku."""

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STOCK = json.load(open("/srv/stock.json"))


class Stock(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        sku = self.path.removeprefix("/stock/")
        if not self.path.startswith("/stock/") or sku not in STOCK:
            self.send_error(404, "no such sku")
            return
        body = json.dumps({"sku": sku, "on_hand": STOCK[sku]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("API_PORT", "8080"))), Stock).serve_forever()
