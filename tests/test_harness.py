"""The gloo test harness itself: ranks fork from a server that has megatron-core imported.

Without the preload every rank spends about 8 s importing torch and megatron-core, which more than
doubles CI's time (30 minutes on 2 cores is the limit); the fork server drops a failed preload
silently, so this checks it took.
"""

from tests.utils import PRELOAD, run_ranks, workers


def test_ranks_start_with_megatron_core_imported():
    names = [*PRELOAD, "megatron.core"]
    for result in run_ranks(workers.preloaded, 2, names):
        assert result == {name: True for name in names}
