#!/usr/bin/env bash
# Apply hettp's patch to an upstream Megatron-LM checkout at tag core_v0.16.1.
#   bash patches/apply.sh [--check] /path/to/Megatron-LM
# --check only tests that it applies (git apply --check). Afterwards install hettp beside the
# checkout (pip install --no-deps -e /path/to/hettp --config-settings editable_mode=compat; compat:
# `megatron` is a namespace package shared with the checkout) so `megatron.hetero` imports there.
set -euo pipefail
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
dir=${1:-}
[ -n "$dir" ] || { echo "usage: $0 [--check] MEGATRON_LM_DIR" >&2; exit 2; }
patch=$(cd "$(dirname "$0")" && pwd)/megatron-lm-core_v0.16.1.patch
if [ ! -f "$dir/pretrain_gpt.py" ] || [ ! -d "$dir/megatron/training" ]; then
  echo "apply.sh: $dir is not a Megatron-LM checkout (no pretrain_gpt.py, megatron/training)" >&2
  exit 2
fi
if git -C "$dir" rev-parse --show-toplevel >/dev/null 2>&1; then
  tag=$(git -C "$dir" describe --tags --exact-match 2>/dev/null || true)
  if [ "$tag" != core_v0.16.1 ]; then
    echo "apply.sh: warning: $dir is at '${tag:-an untagged commit}'; the patch is for core_v0.16.1" >&2
  fi
fi
real=$(cd "$dir" && pwd -P)
# Inside another git repository (an extracted tree in a project's checkout) git apply takes
# paths from that repository's root and skips the rest, silently: look no further up than here
apply() { (cd "$real" && GIT_CEILING_DIRECTORIES=$(dirname "$real") git apply "$@" "$patch"); }
apply --check
if [ "$check" = 1 ]; then echo "apply.sh: the patch applies cleanly to $dir"; exit 0; fi
apply
grep -q "from megatron.hetero import upstream as het_tp" "$real/pretrain_gpt.py" || {
  echo "apply.sh: git apply left $dir/pretrain_gpt.py unpatched" >&2; exit 1; }
echo "apply.sh: patched $dir (pretrain_gpt.py, gpt_builders.py, megatron/training/training.py, megatron/training/checkpointing.py)"
