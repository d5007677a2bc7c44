"""`python -m launcher.prepare [--model-id X] [--revision R]`: resolve or prepare the model, print its folder.

The Makefile runs it before serve and test, so the one-time conversion of an embedded model (or a Hub
download) happens there, not inside a service that has a start-up deadline; each stage of a conversion logs a
line to stderr. The flags read MODEL_ID and REVISION from the environment as `switchyard serve` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from libs.runtime import model_store


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s prepare: %(message)s")
    p = argparse.ArgumentParser(prog="python -m launcher.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--model-id", default=os.environ.get("MODEL_ID"), help=model_store.MODEL_ID_HELP)
    p.add_argument("--revision", default=os.environ.get("REVISION"), help="Hub branch, tag or commit")
    args = p.parse_args(argv)
    try:
        path = model_store.resolve_model(args.model_id, revision=args.revision, token=os.environ.get("HF_TOKEN"))
    except model_store.ModelNotAvailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)  # stdout carries only the path, for `$(python -m launcher.prepare)`
    return 0


if __name__ == "__main__":
    sys.exit(main())
