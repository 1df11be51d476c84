#!/usr/bin/env python
"""The example project's manage.py. It imports as ``examples.djangoshop``, so the repository's
root goes on the import path first, wherever it is run from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.djangoshop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
