"""Audio windows (stages/decode/media.windows): contiguous, never longer than the model's
window, and cut in a pause rather than at a fixed mark, so a sentence spoken across 30 s stays
in one window."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpipe.stages.decode import samples
from mmpipe.stages.decode.media import PAUSE_FRAME_S, PAUSE_SEARCH, windows

RATE = 16_000


@settings(max_examples=60, deadline=None)
@given(seconds=st.floats(0.0, 100.0), window_s=st.sampled_from([5.0, 30.0]), seed=st.integers(0, 2**16),
       quiet=st.lists(st.floats(0.0, 100.0), max_size=6))
def test_windows_tile_the_audio_within_the_window_length(seconds, window_s, seed, quiet):
    rate = 1_000  # small, so long clips stay cheap
    pcm = np.random.default_rng(seed).uniform(-1, 1, int(seconds * rate)).astype(np.float32)
    for at in quiet:  # pauses where a cut may fall
        pcm[int(at * rate) : int((at + 0.5) * rate)] = 0.0
    cut = list(windows(pcm, rate, window_s))
    assert np.array_equal(np.concatenate([c for _, c in cut]), pcm)
    starts = np.cumsum([0] + [c.size for _, c in cut[:-1]])
    assert [o for o, _ in cut] == [s / rate for s in starts]
    size = int(window_s * rate)
    assert all(c.size <= size for _, c in cut)
    shortest = size * (1 - PAUSE_SEARCH) - PAUSE_FRAME_S * rate
    assert all(c.size >= shortest for _, c in cut[:-1])  # a cut only in the last third: no tiny windows


def test_silence_keeps_windows_full_and_a_short_clip_is_one_window():
    silent = list(windows(np.zeros(60 * RATE, dtype=np.float32), RATE, 30.0))
    assert [(o, c.size) for o, c in silent] == [(0.0, 30 * RATE), (30.0, 30 * RATE)]
    (whole,) = windows(np.zeros(3 * RATE, dtype=np.float32), RATE, 30.0)
    assert whole[0] == 0.0 and whole[1].size == 3 * RATE
    (empty,) = windows(np.zeros(0, dtype=np.float32), RATE, 30.0)
    assert empty[1].size == 0


def test_a_sentence_spoken_across_the_30_s_mark_stays_in_one_window():
    """Speech from 1 s, then a sentence from 28.6 s to past 30 s: the cut falls in the pause
    before it, where a fixed 30 s cut would split its words between two windows."""
    first = samples.speech_pcm("Good morning everyone.", lead_s=1.0, tail_s=0.0)
    second = samples.speech_pcm("Please close the door when you leave.", lead_s=0.0, tail_s=1.0)
    start = int(28.6 * RATE)
    pcm = np.concatenate([first, np.zeros(start - first.size, dtype=np.float32), second])
    assert start < 30 * RATE < start + np.flatnonzero(np.abs(second) > 0.01)[-1]  # it does cross 30 s
    (o1, w1), (o2, w2) = windows(pcm, RATE, 30.0)
    assert o2 * RATE <= start + np.flatnonzero(np.abs(second) > 0.01)[0]  # all of the sentence in window 2
    assert o2 >= 20.0 and w1.size + w2.size == pcm.size
