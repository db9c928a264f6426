"""scripts/gpu_smoke.sh runs on a lent GPU only; here, what can go wrong before one: it must
parse, and pass no flag het-TP refuses on CUDA."""

from __future__ import annotations

import os
import re
import subprocess

from tests.utils import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.sh")


def test_the_gpu_smoke_test_parses_and_asks_for_nothing_cuda_refuses():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    with open(SCRIPT) as f:
        text = f.read()
    # --het-tp-emulate and its dilation are CPU-only (hettp.config.HetTPConfig.validated): the
    # het run's straggler is a kernel loop sharing GPU 1
    assert not re.search(r"--het-tp-emulate\b", text)
    assert "scripts/noisy_neighbor.py --gpu 1" in text
