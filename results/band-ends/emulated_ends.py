"""Ended straggles in the emulated mode (only the slow rank's units slowed, as --het-tp-emulate
does): TP=2 rank 0, TP=4 ranks 1 and 2, 1.5x/2.5x/4x ending at step 20 or 26, 5% noise, 4 seeds
each (72 runs, the cases of tests/hettp/test_noisy_timings.py::
test_an_emulated_straggles_end_is_followed_back_to_even). Prints how many never came back to
within NEAR_EVEN of even, and how many did within 2 and within 8 steps of the end.

    .venv/bin/python results/band-ends/emulated_ends.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hettp.sim.noisy import end_lags  # noqa: E402

lags = end_lags(((2, 0), (4, 1), (4, 2)), (1.5, 2.5, 4.0), (20, 26), 4, True)
back = [lag for lag in lags if lag is not None]
print(
    f"{len(lags)} ended straggles: never back {len(lags) - len(back)}, back within 2 steps "
    f"{sum(lag <= 2 for lag in back)}, within 8 {sum(lag <= 8 for lag in back)}"
)
