"""`switchyard serve`'s arguments, parsed as the launcher parses them."""

from launcher.cli import build_parser


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])
