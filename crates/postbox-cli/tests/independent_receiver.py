#!/usr/bin/env python3
"""A webhook receiver that verifies deliveries with an implementation that is
not postbox's own: the `standardwebhooks` package (the Standard Webhooks
reference library for Python).

Used by crates/postbox-cli/tests/receive.rs: `postbox relay --sink http://…`
delivers to it. Secret from POSTBOX_WEBHOOK_SECRET (one `whsec_…`). Listens on
127.0.0.1:PORT (argv[1]); prints "ready" once listening, then one line per
request: "ok <webhook-id> <CloudEvents id>" when the signature verifies (answers
204), "bad <reason>" otherwise (answers 400). Exits 3 when a package is missing.

Install: python3 -m pip install standardwebhooks
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    from standardwebhooks.webhooks import Webhook
except ImportError as e:
    print(f"independent_receiver.py: {e}; install with: python3 -m pip install standardwebhooks pyjwt",
          file=sys.stderr)
    sys.exit(3)

WEBHOOK = Webhook(os.environ["POSTBOX_WEBHOOK_SECRET"])
OUT = threading.Lock()


def say(line):
    # Requests are handled on several threads: one whole line at a time.
    with OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            WEBHOOK.verify(body, headers)
            event = json.loads(body)
            line = f"ok {headers.get('webhook-id')} {event.get('id')}"
            status = 204
        except Exception as e:  # the library raises WebhookVerificationError
            line = f"bad {type(e).__name__}: {e}"
            status = 400
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()
        say(line)

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
say("ready")
server.serve_forever()
