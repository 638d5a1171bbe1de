"""Topics, the embedded broker, the faust apps and the shared stage machinery."""
