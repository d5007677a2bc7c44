"""`switchyard keygen` (also `python -m launcher.keygen`): a new CURVE keypair for the bus.

It prints (or writes to a new 0600 file with --out) two shell assignments:

    SWITCHYARD_CURVE_PUBLIC_KEY='…'
    SWITCHYARD_CURVE_SECRET_KEY='…'

Z85 has no quote characters, so the single quotes make them safe to `source` (Z85 does use `$`, `&`,
`#`, …). Hosts that bind the bus (router, schedulers) need the secret; hosts that only connect (and
`switchyard tap`) need only the public line. The same file works as --bus-curve-secret-key FILE.

With --client it makes a client keypair instead (SWITCHYARD_CURVE_CLIENT_PUBLIC_KEY / _SECRET_KEY, after a
comment with the key's fingerprint): the file is --bus-curve-client-key FILE on the host (or the tap's
--curve-client-key), and its public line goes into the binders' --bus-curve-allowed-keys file
(`grep PUBLIC client.key >> allowed-keys`).
"""

from __future__ import annotations

import argparse
import os
import sys

from launcher.bus_flags import CLIENT_PUBLIC_VAR, CLIENT_SECRET_VAR, PUBLIC_VAR, SECRET_VAR
from libs.runtime import bus, bus_auth


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write the pair to this new file (mode 0600) instead of standard output")
    p.add_argument(
        "--client",
        action="store_true",
        help="a client keypair (--bus-curve-client-key), whose public line goes into --bus-curve-allowed-keys",
    )


def text(client: bool = False) -> str:
    public, secret = bus.curve_keypair()
    if client:
        head = f"# bus client key, fingerprint {bus_auth.fingerprint(public)}\n"
        return f"{head}{CLIENT_PUBLIC_VAR}='{public}'\n{CLIENT_SECRET_VAR}='{secret}'\n"
    return f"{PUBLIC_VAR}='{public}'\n{SECRET_VAR}='{secret}'\n"


def run(args: argparse.Namespace) -> int:
    if not args.out:
        sys.stdout.write(text(args.client))
        return 0
    try:  # O_EXCL: never overwrite a key (or follow a link planted where it goes)
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SystemExit(f"error: --out {args.out}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text(args.client))
    print(f"wrote a CURVE {'client ' if args.client else ''}keypair to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="switchyard keygen", description="Print a new CURVE keypair for the bus.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
