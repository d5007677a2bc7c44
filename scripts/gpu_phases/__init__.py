"""The phases of scripts/gpu_check.py, one module each, and the report they write."""
