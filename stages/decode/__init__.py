"""The decode stage: the stage itself, PyAV media decoding and the input rules it applies."""
