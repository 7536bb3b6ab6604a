"""The house rules a newcomer can count on: no function in eldr_cli over 80 lines, no module over 400."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_long_functions_or_modules():
    r = subprocess.run([sys.executable, "-m", "tools.list_long_functions"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("0 over a limit outside the known modules")
