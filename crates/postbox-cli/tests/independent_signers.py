#!/usr/bin/env python3
"""Sign a delivery with implementations that are not postbox's own.

Used by crates/postbox-cli/tests/receive.rs to check that `postbox receive`
accepts what third-party signers produce:

  webhooks      the `standardwebhooks` package (the Standard Webhooks reference
                library for Python); secret from POSTBOX_WEBHOOK_SECRET.
  qstash URL    a QStash-style token made with PyJWT (HS256, iss=Upstash,
                sub=URL, body=base64url(SHA-256(body))); key from
                QSTASH_CURRENT_SIGNING_KEY.

Prints one JSON object: {"headers": {name: value}, "body": "<the exact body>"}.
Exits 3 with an install hint when a package is missing.

Install: python3 -m pip install standardwebhooks pyjwt
"""

import base64
import hashlib
import json
import os
import sys
import time
import uuid
from datetime import datetime, timezone

INSTALL_HINT = "install the test dependencies with: python3 -m pip install standardwebhooks pyjwt"


def require_env(name):
    value = os.environ.get(name)
    if not value:
        sys.exit(f"independent_signers.py: environment variable {name} is not set")
    return value


def body_for(kind):
    return json.dumps(
        {"kind": kind, "order_id": 42, "note": "signed outside postbox", "nonce": uuid.uuid4().hex},
        separators=(", ", ": "),
    )


def sign_webhooks():
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError as e:
        print(f"independent_signers.py: {e}; {INSTALL_HINT}", file=sys.stderr)
        sys.exit(3)
    secret = require_env("POSTBOX_WEBHOOK_SECRET").split()[0]
    msg_id = "msg_" + uuid.uuid4().hex
    now = datetime.now(tz=timezone.utc)
    body = body_for("webhooks")
    signature = Webhook(secret).sign(msg_id=msg_id, timestamp=now, data=body)
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
        "content-type": "application/json",
    }
    # Self-check with the library's own verifier, so a broken signer cannot pass as a
    # receiver bug.
    Webhook(secret).verify(body, headers)
    return headers, body


def sign_qstash(url):
    try:
        import jwt
    except ImportError as e:
        print(f"independent_signers.py: {e}; {INSTALL_HINT}", file=sys.stderr)
        sys.exit(3)
    key = require_env("QSTASH_CURRENT_SIGNING_KEY")
    body = json.dumps(
        {
            "specversion": "1.0",
            "id": "evt_" + uuid.uuid4().hex,
            "type": "order.created",
            "source": "independent-signer",
            "data": {"order_id": 42},
        }
    )
    now = int(time.time())
    digest = hashlib.sha256(body.encode()).digest()
    claims = {
        "iss": "Upstash",
        "sub": url,
        "iat": now,
        "nbf": now,
        "exp": now + 300,
        "jti": "jwt_" + uuid.uuid4().hex,
        "body": base64.urlsafe_b64encode(digest).decode(),
    }
    token = jwt.encode(claims, key, algorithm="HS256")
    headers = {"upstash-signature": token, "content-type": "application/json"}
    return headers, body


def main(argv):
    if len(argv) >= 2 and argv[1] == "webhooks":
        headers, body = sign_webhooks()
    elif len(argv) >= 3 and argv[1] == "qstash":
        headers, body = sign_qstash(argv[2])
    else:
        sys.exit("usage: independent_signers.py webhooks | qstash URL")
    json.dump({"headers": headers, "body": body}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv)
