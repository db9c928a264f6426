"""scripts/upstream_cpu.py and its shims (megatron/hetero/upstream_cpu.py) without an upstream
tree: the line check that makes a moved upstream spot fail at start, the launcher's errors, and
the rebinding of the config's sync hooks after a rebuild. The shims themselves run in
test_upstream_training.py, on upstream's own pretrain_gpt.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from megatron.hetero import upstream_cpu
from megatron.hetero.cpu_compat import CompatError
from megatron.hetero.partition import SYNC_HOOKS, _rebind_hooks
from tests.utils import ROOT

LAUNCHER = os.path.join(ROOT, "scripts", "upstream_cpu.py")


def _fake_tree(root, shift: dict[str, int] | None = None) -> str:
    """A tree holding every shim's upstream line where the shim expects it (moved down by
    `shift[name]` lines for the named shims)."""
    shift = shift or {}
    files: dict[str, dict[int, str]] = {}
    for shim in upstream_cpu.SHIMS:
        files.setdefault(shim.file, {})[shim.line + shift.get(shim.name, 0)] = shim.text
    for name, lines in files.items():
        path = os.path.join(str(root), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        body = [lines.get(n, f"# line {n}") for n in range(1, max(lines) + 1)]
        with open(path, "w") as handle:
            handle.write("\n".join(body) + "\n")
    return str(root)


def test_every_shim_names_a_file_a_line_and_the_text_there():
    names = [shim.name for shim in upstream_cpu.SHIMS]
    assert len(names) == len(set(names))
    for shim in upstream_cpu.SHIMS:
        assert shim.file and shim.line > 0 and shim.text and shim.why, shim.name


def test_check_accepts_the_lines_where_expected_or_a_few_lines_off(tmp_path):
    upstream_cpu.check(_fake_tree(tmp_path / "a"))
    # hettp's patch adds a few lines above some of them
    upstream_cpu.check(_fake_tree(tmp_path / "b", {"ddp_stream": upstream_cpu.SLACK}))


def test_check_names_each_moved_line_and_missing_file(tmp_path):
    tree = _fake_tree(tmp_path, {"ddp_stream": upstream_cpu.SLACK + 1, "device_arch": 40})
    os.remove(os.path.join(tree, "megatron/core/datasets/Makefile"))
    with pytest.raises(CompatError) as err:
        upstream_cpu.check(tree)
    message = str(err.value)
    assert "megatron/training/training.py:1325 is " in message
    assert "expected 'ddp_stream = torch.cuda.Stream()'" in message
    assert "megatron/training/arguments.py:928" in message
    assert "megatron/core/datasets/Makefile: No such file or directory" in message
    assert "initialize.py" not in message  # the lines that are in place are not named


def _launch(*argv):
    return subprocess.run(
        [sys.executable, LAUNCHER, *argv], capture_output=True, text=True, timeout=120
    )


def test_the_launcher_refuses_a_tree_whose_lines_moved_before_running_anything(tmp_path):
    tree = _fake_tree(tmp_path, {"allow_no_cuda": 30})
    entry = os.path.join(tree, "pretrain_gpt.py")
    with open(entry, "w") as handle:
        handle.write("raise SystemExit('ran')\n")
    out = _launch(entry, "--tensor-model-parallel-size", "2")
    assert out.returncode == 1
    assert out.stderr.startswith("upstream_cpu: error: this Megatron-LM is not the one")
    assert "megatron/training/initialize.py:62" in out.stderr
    assert "ran" not in out.stderr


def test_the_launcher_explains_its_usage(tmp_path):
    out = _launch()
    assert out.returncode == 2 and "usage: torchrun" in out.stderr
    out = _launch(str(tmp_path / "pretrain_gpt.py"))
    assert out.returncode == 2 and "is not a file" in out.stderr


def test_a_rebuild_points_every_set_sync_hook_at_the_new_wrapper():
    class Wrapper:
        def no_sync(self):
            return self

        def start_grad_sync(self):
            return self

        def start_param_sync(self):
            return self

    old, new = Wrapper(), Wrapper()

    def elsewhere():
        return None

    config = types.SimpleNamespace(
        no_sync_func=old.no_sync,
        grad_sync_func=[old.start_grad_sync],  # upstream keeps one per model chunk
        param_sync_func=None,
    )
    _rebind_hooks(config, old, new)
    assert config.no_sync_func() is new
    assert [f() for f in config.grad_sync_func] == [new]
    assert config.param_sync_func is None  # unset stays unset
    config.param_sync_func = elsewhere  # not the wrapper's: left alone
    _rebind_hooks(config, new, old)
    assert config.param_sync_func is elsewhere
    assert set(SYNC_HOOKS) == {"no_sync_func", "grad_sync_func", "param_sync_func"}
