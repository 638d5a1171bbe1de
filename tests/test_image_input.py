"""Image crops travel as uint8 and are normalised by the model: the same input as torchvision's
float pipeline, at half the bytes of the float16 crops sent before."""

import numpy as np
import torch
from torchvision.transforms import v2

from mmpipe.models.image_classifier import resnet18_spec


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
