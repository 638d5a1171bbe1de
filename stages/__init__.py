"""One module per pipeline stage: decode, preprocess, inference, sink."""
