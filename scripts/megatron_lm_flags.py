#!/usr/bin/env python3
"""Write megatron/hetero/megatron_lm_flags.py from a Megatron-LM checkout's own parser:

    python scripts/megatron_lm_flags.py /path/to/Megatron-LM [--check]

The list lets pretrain_gpt.py tell a Megatron-LM flag it does not support from a typo. It is
read from upstream's `add_megatron_arguments` (the parser pretrain_gpt.py builds), imported
under hettp's CPU shims (megatron/hetero/upstream_cpu.py), so on a machine without CUDA.
`--check` writes nothing and exits 1 where the committed list differs
(tests/hetero/test_upstream.py runs it in CI).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "megatron", "hetero", "megatron_lm_flags.py")
HEADER = '''"""The flags of Megatron-LM's own parser at {version} (add_megatron_arguments; not
the kitchen and modelopt flags it adds only where those packages import), written by
scripts/megatron_lm_flags.py. pretrain_gpt.py refuses one it does not support by name, as a
Megatron-LM flag, where a typo is refused as unrecognized."""

VERSION = "{version}"

FLAGS = frozenset(
    """
'''


def upstream_flags(tree: str) -> list[str]:
    sys.path.insert(0, tree)  # upstream's megatron.training, and its megatron.core
    sys.path.insert(1, ROOT)
    from megatron.hetero import upstream_cpu

    upstream_cpu.activate(tree)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return sorted(
        {name for action in parser._actions for name in action.option_strings} - {"-h", "--help"}
    )


def module_text(flags: list[str], version: str) -> str:
    body = "".join(f"    {flag}\n" for flag in flags)
    return HEADER.format(version=version) + body + '    """.split()\n)\n'


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree", help="a Megatron-LM checkout (its megatron/training/arguments.py)")
    p.add_argument("--version", default="core_v0.16.1", help="the checkout's tag, for the record")
    p.add_argument("--check", action="store_true", help="compare with the committed list only")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.tree, "megatron", "training", "arguments.py")):
        p.error(f"{a.tree}: no megatron/training/arguments.py (not a Megatron-LM checkout)")
    text = module_text(upstream_flags(os.path.abspath(a.tree)), a.version)
    if a.check:
        with open(TARGET) as f:
            same = f.read() == text
        print(f"{TARGET}: {'up to date' if same else 'differs from ' + a.tree}")
        return 0 if same else 1
    with open(TARGET, "w") as f:
        f.write(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
