"""Logging setup shared by every service: one line per record, tagged with role and index."""

from __future__ import annotations

import logging
import os


def setup(role: str, index: int) -> logging.Logger:
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s %(levelname)s {role}.{index} %(name)s: %(message)s",
    )
    return logging.getLogger(f"switchyard.{role}")
