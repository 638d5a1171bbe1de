"""Inline JPEG bytes are opened with their demuxer named (no full probe) and decode exactly as
the same file read from a path; bad bytes still fail with the same reason."""

from __future__ import annotations

import numpy as np
import pytest

from mmpipe.stages.decode import samples
from mmpipe.stages.decode.media import DecodeLimits, MediaError, decode_image

LIMITS = DecodeLimits(image_short_side=256)


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_inline_image_decodes_like_the_file(tmp_path, fmt):
    data = samples.encode_image(samples.synthetic_picture(320, 240, seed=2), fmt)
    path = tmp_path / f"picture.{fmt}"
    path.write_bytes(data)
    inline, from_file = decode_image(data, LIMITS), decode_image(path, LIMITS)
    assert np.array_equal(inline.frames[0].rgb, from_file.frames[0].rgb)


@pytest.mark.parametrize("bad", [b"\xff\xd8\xff", b"\xff\xd8\xff" + b"\0" * 200, None])
def test_bytes_that_only_look_like_jpeg_are_undecodable(bad):
    if bad is None:
        bad = samples.corrupt(samples.encode_image(samples.synthetic_picture(64, 48), "jpeg"))
    with pytest.raises(MediaError) as err:
        decode_image(bad, LIMITS)
    assert err.value.reason == "undecodable_media"
