"""mmpipe: streaming multimodal inference on Kafka."""

__version__ = "0.1.0"
