"""Demo webhook receiver for Alertmanager: prints one line per alert of each notification.

Runs in docker-compose (`alert-log` service, standard library only); `docker-compose logs -f
alert-log` shows what would page or open a ticket.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            body = {}
        for alert in body.get("alerts", []):
            labels = alert.get("labels", {})
            notes = alert.get("annotations", {})
            print(
                f"{alert.get('status', '?').upper():8} {labels.get('severity', '-'):6} "
                f"{labels.get('alertname', '?')} {notes.get('summary', '')} "
                f"(runbook: {notes.get('runbook_url', '-')})",
                flush=True,
            )
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    print("alert-log listening on :9095", flush=True)
    sys.stdout.flush()
    HTTPServer(("0.0.0.0", 9095), Handler).serve_forever()
