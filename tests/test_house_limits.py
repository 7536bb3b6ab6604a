"""The house rules a newcomer can count on: no function in eldr_cli or benchmarks/ over 80 lines, no module of
eldr_cli over 400, no benchmark that edits sys.path or imports another benchmark script."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_long_functions_or_modules():
    r = subprocess.run([sys.executable, "-m", "tools.list_long_functions"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("0 over a limit outside the known modules")


SCRIPTS = {"bench_proxy", "bench_routing", "gpu_check"}


def test_benchmark_imports_catch_path_edits_and_cross_script_imports():
    from tools.list_long_functions import benchmark_import_problems

    bad = {
        "import sys\nsys.path.insert(0, 'x')\n": "sys.path.insert",
        "import sys\nsys.path.append('x')\n": "sys.path.append",
        "import sys\nsys.path[:0] = ['x']\n": "assignment to sys.path",
        "import sys\nsys.path += ['x']\n": "assignment to sys.path",
        "import site\nsite.addsitedir('x')\n": "site.addsitedir",
        "import bench_proxy as bp\n": "imports the script bench_proxy",
        "from bench_routing import build\n": "imports a script: from bench_routing import build",
        "from benchmarks.bench_proxy import SHAPE\n": "imports a script: from benchmarks.bench_proxy import SHAPE",
        "from benchmarks import bench_routing\n": "imports a script: from benchmarks import bench_routing",
        "from . import gpu_check\n": "imports a script: from . import gpu_check",
    }
    for source, what in bad.items():
        assert [w for _, w in benchmark_import_problems(source, SCRIPTS)] == [what], source
    fine = ("import sys\nprint(sys.path)\n", "from benchmarks.base import parser\n",
            "from benchmarks.base.procs import spawn\n", "import benchmarks.base.loadgen as lg\n",
            "from eldr_cli.bench.serve import run_bench\n")
    for source in fine:
        assert benchmark_import_problems(source, SCRIPTS) == [], source


def test_benchmarks_have_no_path_edits_or_cross_script_imports():
    from tools.list_long_functions import KNOWN, benchmark_findings

    assert [f for f in benchmark_findings(80) if not f.startswith(KNOWN)] == []
