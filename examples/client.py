"""Raise an approval with the built-in `ask-approval` function and wait until a person answers it.

Start the daemon first (`interactiond serve`), then, from the directory that holds its database:

    python examples/client.py --to ana --prompt "Deploy build 512 to production?"

The script prints the interaction and how to answer it: on the inbox page, with the command line
(`interactiond answer RUN_ID '{"approved": true}'`), or from Python with
`client.interactions.respond(ID, type="approval", approved=True)`. It then waits for the answer
and prints how the run ended. Only the standard library and the `interactiond` module are used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import interactiond


def read_token(args: argparse.Namespace) -> str:
    token = args.token or os.environ.get("INTERACTIOND_TOKEN")
    if token:
        return token
    beside = Path(args.db + ".token")
    if beside.exists():
        return beside.read_text().strip()
    raise SystemExit(f"no token: pass --token, set INTERACTIOND_TOKEN, or run beside {args.db}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8765", help="where the daemon listens")
    parser.add_argument("--token", help="an API token, writer or operator (env: INTERACTIOND_TOKEN)")
    parser.add_argument("--db", default="interactiond.db", help="read the token `serve` wrote beside this file")
    parser.add_argument("--playbook", default="local/default")
    parser.add_argument("--to", default="ana", help="who is asked")
    parser.add_argument("--prompt", default="Deploy build 512 to production?")
    parser.add_argument("--expires", default="PT1H", help="how long the question stands (ISO 8601)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)

    client = interactiond.Client(args.url, read_token(args), playbook=args.playbook)
    try:
        run = client.runs.start("interaction", "ask-approval",
                                {"prompt": args.prompt, "to": args.to, "expires": args.expires})
        for interaction in client.runs.pending_interactions(run["run_id"]):
            print(f"{interaction['id']} ({interaction['type']}) asks {args.to}:")
            print(f"  {interaction['prompt'].strip()}")
            print(f"  expires at {interaction['expires_at']}")
        print("Answer it on the inbox page, or with:")
        print(f"  interactiond answer {run['run_id']} '{{\"approved\": true, \"comment\": \"go\"}}'")
        print("Waiting...", flush=True)
        ended = client.runs.wait(run["run_id"], timeout=args.timeout)
    except interactiond.ClientError as exc:
        print(f"interactiond said: {json.dumps(exc.problem)}", file=sys.stderr)
        return 1
    if ended["status"] == "succeeded":
        verdict = "approved" if ended["output"]["approved"] else "declined"
        comment = ended["output"].get("comment")
        print(f"{verdict}" + (f": {comment}" if comment else ""))
        return 0
    print(f"the run ended {ended['status']} ({ended['kind']})" if ended["status"] not in ("started", "waiting")
          else "no answer yet; the question still stands")
    return 1


if __name__ == "__main__":
    sys.exit(main())
