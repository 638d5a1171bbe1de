"""Image crops travel as uint8 and are normalised by the model: the same input as torchvision's
float pipeline, at half the bytes of the float16 crops sent before."""

import io
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from mmpipe.models.image_classifier import resnet18_spec
from mmpipe.stages.decode import media, samples
from mmpipe.stages.decode.media import DecodeLimits, decode_image, decode_video


def test_uint8_crop_normalised_on_the_device_matches_torchvision_float_pipeline(tmp_path):
    spec = resnet18_spec()
    rgb = np.random.default_rng(1).integers(0, 256, (256, 341, 3), dtype=np.uint8)
    pixels = spec.preprocess({"rgb": rgb}, {})["pixels"]
    assert pixels.dtype == np.uint8 and pixels.shape == (3, 224, 224)
    assert pixels.nbytes == 3 * 224 * 224  # 150 KB on the wire, float16 was 301 KB

    reference = v2.Compose([
        v2.Resize(256, antialias=True), v2.CenterCrop(224),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=spec.mean, std=spec.std),
    ])(torch.from_numpy(rgb).permute(2, 0, 1))
    model = spec.load("cpu", str(tmp_path), allow_random=True)
    ours = model.normalise(torch.from_numpy(pixels[None]))[0]
    assert torch.allclose(ours, reference, atol=1e-5)
    (answer,) = model.predict([{"pixels": pixels}])
    assert len(answer["labels"]) == 5


@pytest.mark.parametrize(("width", "height"), [(640, 480), (480, 640), (300, 256), (200, 150)])
def test_decode_cut_to_the_centre_crop_feeds_the_model_the_same_pixels(width, height):
    """Decode cuts a frame to the model's centre crop (fewer bytes on the decoded topic); the
    model then gets exactly the crop its own preprocess would cut from the whole frame. A
    frame whose short side is under the model's resize travels whole: preprocess scales it."""
    spec = resnet18_spec()
    hints = spec.config.decode
    png = samples.encode_image(samples.synthetic_picture(width, height, seed=3), "png")
    whole = decode_image(png, DecodeLimits(image_short_side=hints.image_short_side))
    cut = decode_image(png, DecodeLimits(image_short_side=hints.image_short_side, image_center_crop=hints.image_center_crop))
    (whole_frame,), (cut_frame,) = whole.frames, cut.frames
    if min(width, height) >= hints.image_short_side:
        assert cut_frame.center_crop == 224 and cut_frame.rgb.shape == (224, 224, 3)
        assert cut_frame.rgb.nbytes < whole_frame.rgb.nbytes
    else:
        assert cut_frame.center_crop is None and np.array_equal(cut_frame.rgb, whole_frame.rgb)
    meta = {"center_crop": cut_frame.center_crop} if cut_frame.center_crop else {}
    expected = spec.preprocess({"rgb": whole_frame.rgb}, {})["pixels"]
    assert np.array_equal(spec.preprocess({"rgb": cut_frame.rgb}, meta)["pixels"], expected)


def test_a_crop_claim_that_does_not_fit_the_frame_is_ignored():
    """The meta's claim is checked against the frame: a whole frame labelled as cut is still
    resized and cut, never passed to the model at the wrong size."""
    spec = resnet18_spec()
    rgb = np.random.default_rng(2).integers(0, 256, (256, 341, 3), dtype=np.uint8)
    assert spec.preprocess({"rgb": rgb}, {"center_crop": 224})["pixels"].shape == (3, 224, 224)


def test_video_frames_are_cut_to_the_centre_crop_too():
    spec = resnet18_spec()
    hints = spec.config.decode
    clip = samples.encode_video(seconds=2.0, width=640, height=360)
    limits = DecodeLimits(image_short_side=hints.image_short_side, image_center_crop=hints.image_center_crop)
    media = decode_video(clip, limits)
    assert media.frames and all(f.center_crop == 224 and f.rgb.shape == (224, 224, 3) for f in media.frames)



def test_the_kept_scaling_context_follows_each_frame_and_thread():
    """decode keeps one swscale context per thread (media._reformatter): images of other sizes,
    one after another, and the same images on another thread, come out pixel for pixel as a
    fresh conversion of each frame (VideoFrame.to_ndarray, what decode did before) makes them."""
    limits = DecodeLimits(image_short_side=256)
    images = [samples.encode_image(samples.synthetic_picture(w, h, seed=w), "jpeg") for w, h in
              [(640, 480), (300, 600), (640, 480), (1024, 300), (320, 320)]]

    def fresh(image: bytes) -> np.ndarray:
        with av.open(io.BytesIO(image), format="jpeg_pipe") as container:
            frame = next(container.decode(video=0))
            width, height = media._scaled_size(frame.width, frame.height, limits.image_short_side)
            return frame.to_ndarray(width=width, height=height, format="rgb24", interpolation="AREA")

    expected = [fresh(image) for image in images]
    assert [decode_image(image, limits).frames[0].rgb.shape for image in images] == [e.shape for e in expected]
    assert all(np.array_equal(decode_image(image, limits).frames[0].rgb, e) for image, e in zip(images, expected))
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda image: decode_image(image, limits).frames[0].rgb, images * 4))
        contexts = set(pool.map(lambda _: id(media._reformatter()), range(8)))
    assert all(np.array_equal(rgb, expected[i % len(images)]) for i, rgb in enumerate(threaded))
    assert media._reformatter() is media._reformatter() and id(media._reformatter()) not in contexts
